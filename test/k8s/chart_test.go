package k8s

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mgpu-dev/mgpu/kube/admission"
	"github.com/mgpu-dev/mgpu/test/e2e"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// chartNamespace is the namespace TestChartInstall installs the chart in.
const chartNamespace = "mgpu-system"

// TestChartInstall installs mgpu with Helm from the chart and the image
// imported into the cluster, in both modes. package: the node side the
// package would run (the enforcers, the CDI spec, the hook) runs on the
// host as in TestMGPU, and the chart runs the node agent (DaemonSet) and
// the webhook (Deployment). image: the chart's DaemonSet also installs the
// hook, the shim, the node configuration and the CDI spec onto the host
// and runs the enforcers. The cluster has no kube-proxy and its API server
// cannot reach pod addresses, so the chart's pods are on the host network,
// talk to the API server at its loopback address (kubernetesAPI), and the
// API server calls the webhook at its URL with a certificate the chart
// makes for 127.0.0.1. Then: the seed's Deployment runs with its quota and
// shares the GPU 30 / 70; helm upgrade with a changed value while a pod
// runs replaces the agent's pod and keeps the instance, its quota, its
// share and (image mode) the shim file it maps; helm uninstall leaves no
// webhook configuration, admission policy, RBAC or object of the release,
// (image mode) none of the files it installed on the host, and pods, with
// and without mgpu resources, are created normally.
func TestChartInstall(t *testing.T) {
	for _, mode := range []string{"package", "image"} {
		t.Run(mode, func(t *testing.T) { testChartInstall(t, mode) })
	}
}

func testChartInstall(t *testing.T, mode string) {
	m := startNodeWith(t, "guaranteed-burst-share", mode == "package")
	fakeEnvOf(m)
	ref := m.importMGPUImage(t)
	repo, tag, _ := strings.Cut(ref, ":")
	api, err := url.Parse(m.APIServerURL)
	if err != nil {
		t.Fatal(err)
	}
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	listen := net.JoinHostPort("127.0.0.1", fmt.Sprint(ports[0]))
	values := filepath.Join(m.Dir, "mgpu-values.yaml")
	mps := filepath.Join(m.Dir, "nvidia-mps")
	installDir := filepath.Join(m.Dir, "opt-mgpu")
	configDir := filepath.Dir(m.n.ConfigPath) // package mode: the host side's
	nodeConfig := fmt.Sprintf("{run_dir: %q}", m.n.RunDir)
	engineValues := ""
	var eng *engineFiles
	if mode == "image" {
		eng = newEngineFiles(t, m.Dir)
		engineValues = eng.values()
		configDir = filepath.Join(m.Dir, "etc-mgpu")
		gpu := fmt.Sprintf("{name: Simulated-GPU, memory_mib: %d}", gpuMiB)
		nodeConfig = fmt.Sprintf(`{backend: sim, run_dir: %q, state_dir: %q, cdi_spec_dir: %q,
    defaults: {compute_policy: guaranteed-burst-share, online_offline_switch: 1}, sim: {gpus: [%s, %s]}}`,
			m.n.RunDir, m.n.StateDir, e2e.CDISpecDir, gpu, gpu)
	}
	specsBefore := cdiSpecs(t)
	if err := os.WriteFile(values, fmt.Appendf(nil, `image: {repository: %q, tag: %q, pullPolicy: Never}
mode: %s
kubernetesAPI: {host: 127.0.0.1, port: %s}
node:
  hostNetwork: true
  installDir: %q
  configDir: %q
  config: %s
  agent: {nodeInterval: 1s, logLevel: debug, mpsPipeDirectory: %q}
  metrics: {enabled: false}
%s
webhook:
  replicas: 1
  hostNetwork: true
  listen: %q
  url: "https://%s/mutate"
  tls: {ipAddresses: [127.0.0.1]}
`, repo, tag, mode, api.Port(), installDir, configDir, nodeConfig, mps, engineValues, listen, listen), 0o600); err != nil {
		t.Fatal(err)
	}
	installed := false
	t.Cleanup(func() {
		if installed {
			if out, err := m.helm(t, "uninstall", "mgpu", "--namespace", chartNamespace, "--wait", "--timeout", "2m"); err != nil {
				t.Errorf("helm uninstall: %v\n%s", err, out)
			}
		}
	})
	t0 := time.Now()
	if out, err := m.helm(t, "install", "mgpu", ChartDir, "--namespace", chartNamespace, "--create-namespace",
		"--values", values, "--wait", "--timeout", "3m"); err != nil {
		m.describeRelease(t)
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	installed = true
	t.Logf("helm install: ready in %v", time.Since(t0).Round(time.Millisecond))
	m.waitResources(t, 60*time.Second)
	eng.checkConfigured(t, "install", 1)

	t.Run("SeedDeployment", func(t *testing.T) { testSeed(t, m) })

	t.Run("Upgrade", func(t *testing.T) {
		p30 := m.deploy(t, seedDeployment("upgrade30", "guaranteed-burst-share", 30, 4096, saturate(3600)))
		p30 = m.running(t, p30.Name, "start")
		before := m.instanceOf(t, p30)
		shimBefore := installedShims(t, installDir)
		if mode == "image" && len(shimBefore) != 1 {
			t.Fatalf("installed shims %v, want the one build's", shimBefore)
		}
		agent := m.agentPod(t)
		t0 := time.Now()
		if out, err := m.helm(t, "upgrade", "mgpu", ChartDir, "--namespace", chartNamespace, "--reuse-values",
			"--set", "node.agent.logLevel=info", "--wait", "--timeout", "3m"); err != nil {
			m.describeRelease(t)
			t.Fatalf("helm upgrade: %v\n%s", err, out)
		}
		after := m.agentPod(t)
		t.Logf("helm upgrade: ready in %v; agent pod %s -> %s", time.Since(t0).Round(time.Millisecond), agent.Name, after.Name)
		var cmd []string
		for _, c := range after.Spec.Containers {
			if c.Name == "agent" {
				cmd = c.Command
			}
		}
		if after.UID == agent.UID || !slices.Contains(cmd, "--log-level=info") {
			t.Errorf("the upgrade did not replace the agent's pod with the new value: %s %q", after.Name, cmd)
		}
		m.waitResources(t, 60*time.Second)
		eng.checkConfigured(t, "upgrade", 1) // nothing changed: not restarted
		if shimAfter := installedShims(t, installDir); !slices.Equal(shimAfter, shimBefore) {
			t.Errorf("installed shims %v after the upgrade, %v before", shimAfter, shimBefore)
		}
		if in := m.instanceOf(t, p30); in.Name != before.Name || in.Core != before.Core || in.MemoryMiB != before.MemoryMiB {
			t.Errorf("instance %+v after the upgrade, %+v before", in, before)
		}
		p70 := m.deploy(t, seedDeployment("upgrade70", "guaranteed-burst-share", 70, 4096, saturate(3600)))
		p70 = m.running(t, p70.Name, "start")
		if g30, g70 := m.instanceOf(t, p30).Device, m.instanceOf(t, p70).Device; g30 != g70 {
			t.Fatalf("the 30 is on GPU %d, the 70 on GPU %d", g30, g70)
		}
		s := m.shares(t, []*corev1.Pod{p30, p70}, time.Second, 5*time.Second)
		t.Logf("after the upgrade, 30 / 70 both busy: %.2f / %.2f", s[0], s[1])
		if !within(s[0], 30) || !within(s[1], 70) {
			t.Errorf("shares %.2f / %.2f after the upgrade, want 30 / 70 ± %.0f", s[0], s[1], epsilon)
		}
	})

	t.Run("Uninstall", func(t *testing.T) {
		t0 := time.Now()
		if out, err := m.helm(t, "uninstall", "mgpu", "--namespace", chartNamespace, "--wait", "--timeout", "2m"); err != nil {
			t.Fatalf("helm uninstall: %v\n%s", err, out)
		}
		installed = false
		t.Logf("helm uninstall: done in %v", time.Since(t0).Round(time.Millisecond))
		ctx := context.Background()
		if _, err := m.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, admission.ConfigurationName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("the webhook configuration is left: %v", err)
		}
		sel := metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=mgpu"}
		left := []string{}
		if l, err := m.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().List(ctx, sel); err == nil {
			for _, o := range l.Items {
				left = append(left, "ValidatingAdmissionPolicy/"+o.Name)
			}
		}
		if l, err := m.Client.RbacV1().ClusterRoles().List(ctx, sel); err == nil {
			for _, o := range l.Items {
				left = append(left, "ClusterRole/"+o.Name)
			}
		}
		if l, err := m.Client.RbacV1().ClusterRoleBindings().List(ctx, sel); err == nil {
			for _, o := range l.Items {
				left = append(left, "ClusterRoleBinding/"+o.Name)
			}
		}
		if l, err := m.Client.CoreV1().Secrets(chartNamespace).List(ctx, sel); err == nil {
			for _, o := range l.Items {
				left = append(left, "Secret/"+o.Name)
			}
		}
		if len(left) > 0 {
			t.Errorf("left after helm uninstall: %v", left)
		}
		// The release's pods end within their grace periods.
		err := harness.WaitFor(90*time.Second, func() error {
			l, err := m.Client.CoreV1().Pods(chartNamespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			if len(l.Items) > 0 {
				return fmt.Errorf("%d pods of the release left, %s first", len(l.Items), l.Items[0].Name)
			}
			return nil
		})
		if err != nil {
			t.Error(err)
		}
		t.Logf("helm uninstall: the release's pods gone after %v", time.Since(t0).Round(time.Millisecond))
		// What the installer put on the host is gone (image mode; in
		// package mode the chart put nothing there).
		if shims := installedShims(t, installDir); len(shims) != 0 {
			t.Errorf("installed builds left: %v", shims)
		}
		if _, err := os.Stat(filepath.Join(configDir, "config.toml")); mode == "image" && !os.IsNotExist(err) {
			t.Errorf("the node configuration is left: %v", err)
		}
		if after := cdiSpecs(t); !slices.Equal(after, specsBefore) {
			t.Errorf("CDI specs %v after uninstall, %v before install", after, specsBefore)
		}
		eng.checkRestored(t, installDir)
		// Pods are created normally: one without mgpu resources runs, one
		// with them is admitted (no webhook refuses or changes it).
		plain := workloadPod("after-uninstall", "", 0, 0, idle)
		if _, err := m.Client.CoreV1().Pods("default").Create(ctx, plain, metav1.CreateOptions{}); err != nil {
			t.Fatalf("a pod without mgpu resources after uninstall: %v", err)
		}
		m.WaitPodPhase(t, "default", plain.Name, corev1.PodRunning, 60*time.Second)
		var created *corev1.Pod
		withGPU := workloadPod("after-uninstall-gpu", "fixed-share", 30, 4096, idle)
		created, err = m.Client.CoreV1().Pods("default").Create(ctx, withGPU, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("a pod with mgpu resources after uninstall: %v", err)
		}
		if created.Spec.Affinity != nil {
			t.Errorf("a webhook still changed the pod: affinity %+v", created.Spec.Affinity)
		}
		for _, name := range []string{plain.Name, withGPU.Name} {
			if err := m.Client.CoreV1().Pods("default").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
				t.Error(err)
			}
		}
	})
}

// engineFiles is the container engine the chart configures in image mode
// (node.engine): a Docker daemon.json of the test's, and a restart command
// that records its runs. The cluster's own engine is containerd 2.x, which
// needs nothing, and this machine has no systemd to restart an engine:
// what is checked is the chart's step, the files and when it restarts.
type engineFiles struct {
	daemon, original, script, restarts string
}

func newEngineFiles(t *testing.T, dir string) *engineFiles {
	t.Helper()
	e := &engineFiles{daemon: filepath.Join(dir, "etc-docker", "daemon.json"), original: "{\n  \"log-level\": \"warn\"\n}\n",
		script: filepath.Join(dir, "engine-restart.sh")}
	// The restart command runs in the host's root mounted read-only; its
	// record goes to a tmpfs of its own (/dev/shm), which stays writable.
	f, err := os.CreateTemp("/dev/shm", "mgpu-engine-restarts-")
	if err != nil {
		t.Fatal(err)
	}
	e.restarts = f.Name()
	_ = f.Close()
	t.Cleanup(func() { _ = os.Remove(e.restarts) })
	if err := os.MkdirAll(filepath.Dir(e.daemon), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.daemon, []byte(e.original), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.script, []byte("echo restarted >> "+e.restarts+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *engineFiles) values() string {
	return fmt.Sprintf("  engine: {name: docker, configFile: %q, restart: %q}", e.daemon, "/bin/sh "+e.script)
}

func (e *engineFiles) nRestarts(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile(e.restarts)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(data), "restarted\n")
}

// checkConfigured: daemon.json enables CDI with the node's spec
// directories, and the engine was restarted restarts times in all.
func (e *engineFiles) checkConfigured(t *testing.T, after string, restarts int) {
	t.Helper()
	if e == nil {
		return
	}
	data, err := os.ReadFile(e.daemon)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), `"cdi": true`) || !strings.Contains(string(data), e2e.CDISpecDir) || !strings.Contains(string(data), `"log-level": "warn"`) {
		t.Errorf("daemon.json after %s: %s", after, data)
	}
	n := e.nRestarts(t)
	t.Logf("node.engine after %s: daemon.json configured, %d restart(s) of the engine", after, n)
	if n != restarts {
		t.Errorf("the engine restarted %d times by the end of the %s, want %d", n, after, restarts)
	}
}

// checkRestored: after uninstall daemon.json holds what it held before
// install, the engine restarted once more, and no record is left.
func (e *engineFiles) checkRestored(t *testing.T, installDir string) {
	t.Helper()
	if e == nil {
		return
	}
	data, err := os.ReadFile(e.daemon)
	if err != nil || string(data) != e.original {
		t.Errorf("daemon.json after uninstall: %q (%v), want %q as before install", data, err, e.original)
	}
	n := e.nRestarts(t)
	t.Logf("node.engine after uninstall: daemon.json as before install: %v; %d restarts in all", string(data) == e.original, n)
	if n != 2 {
		t.Errorf("the engine restarted %d times in all, want 2 (install, uninstall)", n)
	}
	if _, err := os.Stat(filepath.Join(installDir, "engine-record.json")); !os.IsNotExist(err) {
		t.Errorf("the engine record is left: %v", err)
	}
}

// installedShims lists the shims installed under dir (one per build
// directory), each with its inode and modification time.
func installedShims(t *testing.T, dir string) []string {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*", "lib", "mgpu", "libmgpu-shim.so"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := fi.Sys().(*syscall.Stat_t)
		out = append(out, fmt.Sprintf("%s (inode %d, %s)", p, st.Ino, fi.ModTime().Format(time.RFC3339Nano)))
	}
	return out
}

// cdiSpecs lists the CDI spec directory the cluster's containerd reads.
func cdiSpecs(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(e2e.CDISpecDir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func within(got, want float64) bool { return got >= want-epsilon && got <= want+epsilon }

// importMGPUImage builds mgpu's image from the build (packaging/image, as
// make image does) and imports it; it returns the image's reference.
func (m *mgpuNode) importMGPUImage(t *testing.T) string {
	t.Helper()
	build, err := fakecuda.BuildDir()
	if err != nil {
		t.Fatal(err)
	}
	if e2e.InstalledFromEnv() != "" {
		// MGPU_BUILD holds only the test fixtures then: the image (the
		// agent and the webhook) is the repository's build's.
		build = filepath.Join("..", "..", "build")
	}
	const repo, version = "mgpu.test/mgpu", "0.0.0-k8s"
	out := filepath.Join(t.TempDir(), "mgpu-image.tar")
	cmd := exec.Command("go", "run", "../../packaging/image", "-build", build, //nolint:gosec // the repository's tool
		"-config", "../../packaging/config/config.toml", "-version", version, "-repository", repo, "-out", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the image: %v\n%s", err, b)
	}
	m.ImportImage(t, out)
	return repo + ":" + version
}

// helm runs the helm binary against the cluster (the admin's kubeconfig)
// with its own configuration, cache and data directories.
func (m *mgpuNode) helm(t *testing.T, args ...string) (string, error) {
	t.Helper()
	bin, err := helmBinary()
	if err != nil {
		t.Fatalf("k8s: %v", err)
	}
	home := filepath.Join(m.Dir, "helm")
	cmd := exec.Command(bin, args...) //nolint:gosec // the test's helm
	cmd.Env = append(os.Environ(), "KUBECONFIG="+m.AdminKubeconfig,
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"), "HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"))
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// agentPod is the running pod of the chart's node DaemonSet.
func (m *mgpuNode) agentPod(t *testing.T) corev1.Pod {
	t.Helper()
	var pod corev1.Pod
	err := harness.WaitFor(60*time.Second, func() error {
		l, err := m.Client.CoreV1().Pods(chartNamespace).List(context.Background(),
			metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=node"})
		if err != nil {
			return err
		}
		var running []corev1.Pod
		for _, p := range l.Items {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				running = append(running, p)
			}
		}
		if len(running) != 1 {
			return fmt.Errorf("%d running node pods of %d", len(running), len(l.Items))
		}
		pod = running[0]
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// describeRelease logs the release's pods and their events, for a failed
// install or upgrade.
func (m *mgpuNode) describeRelease(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	l, err := m.Client.CoreV1().Pods(chartNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Logf("pods of %s: %v", chartNamespace, err)
		return
	}
	for i := range l.Items {
		p := &l.Items[i]
		t.Logf("pod %s:\n%s", p.Name, m.DescribePod(chartNamespace, p.Name, p))
		for _, c := range p.Spec.Containers {
			t.Logf("pod %s container %s log:\n%s", p.Name, c.Name, tailLines(m.PodLog(t, chartNamespace, p.Name, c.Name), 30))
		}
	}
}
