package k8s

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// Network settings of the cluster.
const (
	// ServiceCIDR is the apiserver's --service-cluster-ip-range (no
	// kube-proxy runs: nothing routes to it).
	ServiceCIDR = "10.96.0.0/16"
	// PodCIDR is the pods' subnet on the bridge PodBridge.
	PodCIDR = "10.244.250.0/24"
	// PodBridge is the Linux bridge of the pods: no address on the host,
	// no route, no masquerade, so pods reach nothing beyond each other.
	PodBridge = "mgpu-k8s0"
	// DefaultNodeName is the node's name unless Options say otherwise.
	DefaultNodeName = "mgpu-node"
)

// uninitializedTaint is the taint a kubelet with --cloud-provider=external
// registers its node with; the cluster, acting as that cloud provider,
// sets the node's address and removes it.
const uninitializedTaint = "node.cloudprovider.kubernetes.io/uninitialized"

// Options configure a cluster. The zero value is a working cluster.
type Options struct {
	// NodeName is the node's name (default DefaultNodeName).
	NodeName string
	// NodeLabels are the kubelet's --node-labels.
	NodeLabels map[string]string
	// CDISpecDirs are containerd's cdi_spec_dirs (default /etc/cdi and
	// /var/run/cdi).
	CDISpecDirs []string
	// KubeletConfig, if set, edits the kubelet's configuration file
	// before the kubelet starts (feature gates, reserved resources, ...).
	KubeletConfig func(*kubeletv1beta1.KubeletConfiguration)
	// ExtraKubeletArgs and ExtraAPIServerArgs are appended to the
	// commands' flags (a later flag wins).
	ExtraKubeletArgs   []string
	ExtraAPIServerArgs []string
	// StartTimeout bounds the start, up to a Ready node with a default
	// ServiceAccount (default 3 minutes).
	StartTimeout time.Duration
	// Log receives the cluster's progress lines (default t.Log). The
	// components log to files under Dir/logs, whose tails are t.Logged
	// when the test fails.
	Log io.Writer
}

// Cluster is a running single-node cluster. Its fields are read-only.
type Cluster struct {
	// Client is a clientset with the admin's identity (system:masters).
	Client kubernetes.Interface
	// Config is the admin's REST config (for other clients).
	Config *rest.Config
	// AdminKubeconfig is the path of the admin's kubeconfig.
	AdminKubeconfig string
	// NodeName is the only node's name.
	NodeName string
	// Dir holds everything of the cluster but KubeletRootDir.
	Dir string
	// ContainerdAddress is the CRI containerd's socket.
	ContainerdAddress string
	// APIServerURL is https://127.0.0.1:<port>.
	APIServerURL string
	// CACertPEM is the cluster CA (it signed every serving and client
	// certificate); CACertFile is the same on disk.
	CACertPEM  []byte
	CACertFile string

	opts         Options
	bins         Binaries
	pki          *pki
	host         hostState
	logf         func(format string, args ...any)
	etcd         *component
	apiserver    *component
	ctrlManager  *component
	scheduler    *component
	containerd   *component
	kubelet      *component
	nodeConfig   string // the kubelet's kubeconfig
	podLogsDir   string
	healthzPort  int
	kubeletMu    sync.Mutex
	stopOnce     sync.Once
	kubeconfigNo int
}

// StartCluster starts a cluster for the test and stops it when the test
// ends (t.Cleanup). It skips the test when not root or when a binary is
// missing (test/k8s/deps.sh, test/e2e/deps.sh install them); it fails the
// test when the cluster does not come up. Clusters of different test
// binaries run one at a time (a lock on /run/mgpu-k8s.lock): they share
// KubeletRootDir.
func StartCluster(t *testing.T, opts Options) *Cluster {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("k8s: a cluster needs root (kubelet, containerd)")
	}
	bins, err := FindBinaries()
	if err != nil {
		t.Skipf("k8s: %v; run test/k8s/deps.sh and test/e2e/deps.sh", err)
	}
	if opts.NodeName == "" {
		opts.NodeName = DefaultNodeName
	}
	if len(opts.CDISpecDirs) == 0 {
		opts.CDISpecDirs = []string{"/etc/cdi", "/var/run/cdi"}
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 3 * time.Minute
	}
	c := &Cluster{opts: opts, bins: bins, NodeName: opts.NodeName}
	c.logf = func(format string, args ...any) { t.Logf(format, args...) }
	if opts.Log != nil {
		c.logf = func(format string, args ...any) { _, _ = fmt.Fprintf(opts.Log, "k8s: "+format+"\n", args...) }
	}
	lk, err := lock(10 * time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	c.host.lockFile = lk
	t.Cleanup(func() { c.Stop(t) })
	start := time.Now()
	if err := c.start(t); err != nil {
		t.Fatalf("k8s: start the cluster: %v", err)
	}
	c.logf("cluster up in %v (node %q, apiserver %s, dir %s)", time.Since(start).Round(time.Millisecond), c.NodeName, c.APIServerURL, c.Dir)
	return c
}

func (c *Cluster) start(t *testing.T) error {
	deadline := time.Now().Add(c.opts.StartTimeout)
	left := func() time.Duration { return time.Until(deadline) }
	if err := claimHost(&c.host); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "mgpu-k8s-")
	if err != nil {
		return err
	}
	c.Dir = dir
	if err := os.Chmod(dir, 0o755); err != nil { //nolint:gosec // pods' logs and volumes are read beneath it
		return err
	}
	logs := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logs, 0o755); err != nil { //nolint:gosec // logs
		return err
	}
	if c.pki, err = newPKI(filepath.Join(dir, "pki")); err != nil {
		return err
	}
	c.CACertPEM, c.CACertFile = c.pki.CAPEM, c.pki.CAFile
	ports, err := freePorts(6)
	if err != nil {
		return err
	}
	etcdPort, etcdPeer, apiPort, kubeletPort := ports[0], ports[1], ports[2], ports[3]
	c.healthzPort = ports[4]
	c.APIServerURL = fmt.Sprintf("https://127.0.0.1:%d", apiPort)

	// The pause image is built while nothing runs yet.
	t0 := time.Now()
	pauseTar, err := buildPauseImage(filepath.Join(dir, "images"))
	if err != nil {
		return err
	}
	c.logf("pause image built in %v", time.Since(t0).Round(time.Millisecond))

	// --- etcd
	t0 = time.Now()
	c.etcd = &component{name: "etcd", path: c.bins.Etcd, log: filepath.Join(logs, "etcd.log"), args: []string{
		"--name=default", "--data-dir=" + filepath.Join(dir, "etcd"),
		fmt.Sprintf("--listen-client-urls=http://127.0.0.1:%d", etcdPort),
		fmt.Sprintf("--advertise-client-urls=http://127.0.0.1:%d", etcdPort),
		fmt.Sprintf("--listen-peer-urls=http://127.0.0.1:%d", etcdPeer),
		fmt.Sprintf("--initial-advertise-peer-urls=http://127.0.0.1:%d", etcdPeer),
		fmt.Sprintf("--initial-cluster=default=http://127.0.0.1:%d", etcdPeer),
	}}
	if err := c.etcd.start(); err != nil {
		return err
	}
	if err := harness.WaitFor(left(), func() error {
		if err := c.etcd.checkRunning(); err != nil {
			return harness.Permanent(err)
		}
		return httpOK(fmt.Sprintf("http://127.0.0.1:%d/health", etcdPort), nil)
	}); err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	c.logf("etcd ready in %v", time.Since(t0).Round(time.Millisecond))

	// --- certificates and kubeconfigs
	t0 = time.Now()
	serving, err := c.pki.issue("apiserver", certSpec{cn: "kube-apiserver", server: true,
		dns: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		ips: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv4(10, 96, 0, 1)}})
	if err != nil {
		return err
	}
	kubeletClient, err := c.pki.issue("apiserver-kubelet-client", certSpec{cn: "kube-apiserver-kubelet-client", orgs: []string{"system:masters"}})
	if err != nil {
		return err
	}
	saKey, saPub, err := c.pki.serviceAccountKey()
	if err != nil {
		return err
	}
	c.AdminKubeconfig = filepath.Join(dir, "kubeconfig", "admin.conf")
	cmConf := filepath.Join(dir, "kubeconfig", "controller-manager.conf")
	schedConf := filepath.Join(dir, "kubeconfig", "scheduler.conf")
	c.nodeConfig = filepath.Join(dir, "kubeconfig", "kubelet.conf")
	for _, k := range []struct {
		path, name, cn string
		orgs           []string
	}{
		{c.AdminKubeconfig, "admin", "kubernetes-admin", []string{"system:masters"}},
		{cmConf, "controller-manager", "system:kube-controller-manager", nil},
		{schedConf, "scheduler", "system:kube-scheduler", nil},
		{c.nodeConfig, "kubelet", "system:node:" + c.NodeName, []string{"system:nodes"}},
	} {
		cert, err := c.pki.issue(k.name, certSpec{cn: k.cn, orgs: k.orgs})
		if err != nil {
			return err
		}
		if err := writeKubeconfig(k.path, c.APIServerURL, c.CACertPEM, k.cn, &cert, ""); err != nil {
			return err
		}
	}
	kubeletServing, err := c.pki.issue("kubelet-serving", certSpec{cn: c.NodeName, server: true,
		dns: []string{c.NodeName, "localhost"}, ips: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		return err
	}
	c.logf("certificates in %v", time.Since(t0).Round(time.Millisecond))

	// --- kube-apiserver
	t0 = time.Now()
	c.apiserver = &component{name: "kube-apiserver", path: c.bins.APIServer, log: filepath.Join(logs, "kube-apiserver.log"),
		args: append([]string{
			fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", etcdPort),
			"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", apiPort), "--advertise-address=127.0.0.1",
			"--cert-dir=" + filepath.Join(dir, "apiserver"),
			"--tls-cert-file=" + serving.CertFile, "--tls-private-key-file=" + serving.KeyFile,
			"--client-ca-file=" + c.CACertFile,
			"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
			"--service-account-key-file=" + saPub, "--service-account-signing-key-file=" + saKey,
			"--service-cluster-ip-range=" + ServiceCIDR,
			"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
			"--kubelet-client-certificate=" + kubeletClient.CertFile, "--kubelet-client-key=" + kubeletClient.KeyFile,
			"--kubelet-certificate-authority=" + c.CACertFile, "--kubelet-preferred-address-types=InternalIP",
			"--allow-privileged=true",
			// The kubernetes Service would get 127.0.0.1 as its endpoint, which
			// EndpointSlices refuse; nothing in the cluster routes to it anyway.
			"--endpoint-reconciler-type=none",
			"--v=1",
		}, c.opts.ExtraAPIServerArgs...)}
	if err := c.apiserver.start(); err != nil {
		return err
	}
	if c.Config, err = clientcmd.BuildConfigFromFlags("", c.AdminKubeconfig); err != nil {
		return err
	}
	c.Config.QPS, c.Config.Burst = 100, 200
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return err
	}
	if err := harness.WaitFor(left(), func() error {
		if err := c.apiserver.checkRunning(); err != nil {
			return harness.Permanent(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err
	}); err != nil {
		return fmt.Errorf("kube-apiserver: %w", err)
	}
	c.logf("kube-apiserver ready in %v", time.Since(t0).Round(time.Millisecond))

	// --- controller-manager and scheduler (serving nothing: --secure-port=0)
	c.ctrlManager = &component{name: "kube-controller-manager", path: c.bins.ControllerManager,
		log: filepath.Join(logs, "kube-controller-manager.log"), args: []string{
			"--kubeconfig=" + cmConf, "--secure-port=0", "--leader-elect=false",
			"--use-service-account-credentials=true", "--service-account-private-key-file=" + saKey,
			"--root-ca-file=" + c.CACertFile,
			"--cluster-signing-cert-file=" + c.CACertFile, "--cluster-signing-key-file=" + c.pki.CAKey,
			"--v=1",
		}}
	c.scheduler = &component{name: "kube-scheduler", path: c.bins.Scheduler, log: filepath.Join(logs, "kube-scheduler.log"),
		args: []string{"--kubeconfig=" + schedConf, "--secure-port=0", "--leader-elect=false", "--v=1"}}
	for _, p := range []*component{c.ctrlManager, c.scheduler} {
		if err := p.start(); err != nil {
			return err
		}
	}

	// --- containerd with its CRI
	t0 = time.Now()
	cdir := filepath.Join(dir, "containerd")
	c.ContainerdAddress = filepath.Join(cdir, "containerd.sock")
	cniConf := filepath.Join(dir, "cni", "net.d")
	if err := writeCNIConfig(cniConf, PodBridge, PodCIDR, filepath.Join(dir, "cni", "ipam")); err != nil {
		return err
	}
	if err := os.MkdirAll(cdir, 0o711); err != nil { //nolint:gosec // containerd's root: others traverse it to pods' files
		return err
	}
	cfgPath := filepath.Join(cdir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(containerdConfig(cdir, c.bins.CNI, cniConf, c.opts.CDISpecDirs)), 0o600); err != nil {
		return err
	}
	c.containerd = &component{name: "containerd", path: filepath.Join(c.bins.Containerd, "containerd"),
		log: filepath.Join(logs, "containerd.log"), args: []string{"--config", cfgPath},
		// The shim is found through PATH, runc in /usr/sbin.
		env: append(envWithout(os.Environ(), "PATH"), "PATH="+c.bins.Containerd+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")}
	if err := c.containerd.start(); err != nil {
		return err
	}
	if err := harness.WaitFor(left(), func() error {
		if err := c.containerd.checkRunning(); err != nil {
			return harness.Permanent(err)
		}
		_, err := c.ctr(5*time.Second, "version")
		return err
	}); err != nil {
		return fmt.Errorf("containerd: %w", err)
	}
	if err := c.importImage(pauseTar); err != nil {
		return err
	}
	c.logf("containerd ready, pause image imported in %v", time.Since(t0).Round(time.Millisecond))

	// --- kubelet
	t0 = time.Now()
	c.podLogsDir = filepath.Join(dir, "pod-logs")
	kcPath := filepath.Join(dir, "kubelet", "config.json")
	if err := c.writeKubeletConfig(kcPath, kubeletPort, kubeletServing); err != nil {
		return err
	}
	args := []string{"--config=" + kcPath, "--kubeconfig=" + c.nodeConfig, "--root-dir=" + KubeletRootDir,
		"--hostname-override=" + c.NodeName, "--cloud-provider=external", "--v=2"}
	if len(c.opts.NodeLabels) > 0 {
		keys := make([]string, 0, len(c.opts.NodeLabels))
		for k := range c.opts.NodeLabels {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		labels := make([]string, len(keys))
		for i, k := range keys {
			labels[i] = k + "=" + c.opts.NodeLabels[k]
		}
		args = append(args, "--node-labels="+strings.Join(labels, ","))
	}
	c.kubelet = &component{name: "kubelet", path: c.bins.Kubelet, log: filepath.Join(logs, "kubelet.log"),
		args: append(args, c.opts.ExtraKubeletArgs...)}
	if err := c.kubelet.start(); err != nil {
		return err
	}
	if err := c.waitNode(left(), time.Time{}); err != nil {
		return err
	}
	c.logf("node %q Ready in %v", c.NodeName, time.Since(t0).Round(time.Millisecond))
	if err := harness.WaitFor(left(), func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Client.CoreV1().ServiceAccounts(metav1.NamespaceDefault).Get(ctx, "default", metav1.GetOptions{})
		return err
	}); err != nil {
		return fmt.Errorf("the default ServiceAccount: %w", err)
	}
	return nil
}

func (c *Cluster) writeKubeletConfig(path string, port int, serving issued) error {
	healthz := int32(c.healthzPort) //nolint:gosec // a port
	f, t := false, true
	gcHigh, gcLow := int32(100), int32(99) // no image garbage collection: the images cannot be pulled again
	kc := &kubeletv1beta1.KubeletConfiguration{
		TypeMeta:           metav1.TypeMeta{APIVersion: "kubelet.config.k8s.io/v1beta1", Kind: "KubeletConfiguration"},
		Address:            "127.0.0.1",
		Port:               int32(port), //nolint:gosec // a port
		HealthzBindAddress: "127.0.0.1",
		HealthzPort:        &healthz,
		TLSCertFile:        serving.CertFile,
		TLSPrivateKeyFile:  serving.KeyFile,
		Authentication: kubeletv1beta1.KubeletAuthentication{
			X509:      kubeletv1beta1.KubeletX509Authentication{ClientCAFile: c.CACertFile},
			Webhook:   kubeletv1beta1.KubeletWebhookAuthentication{Enabled: &t},
			Anonymous: kubeletv1beta1.KubeletAnonymousAuthentication{Enabled: &f},
		},
		Authorization:               kubeletv1beta1.KubeletAuthorization{Mode: kubeletv1beta1.KubeletAuthorizationModeWebhook},
		ContainerRuntimeEndpoint:    "unix://" + c.ContainerdAddress,
		CgroupDriver:                "cgroupfs",
		FailSwapOn:                  &f,
		FailCgroupV1:                &f,
		PodLogsDir:                  c.podLogsDir,
		ClusterDomain:               "cluster.local",
		MakeIPTablesUtilChains:      &f,
		SerializeImagePulls:         &f,
		ImageGCHighThresholdPercent: &gcHigh,
		ImageGCLowThresholdPercent:  &gcLow,
		// A test machine's disk may be fuller than a node's should be.
		EvictionHard: map[string]string{"memory.available": "1Mi", "nodefs.available": "1%",
			"nodefs.inodesFree": "1%", "imagefs.available": "1%"},
		NodeStatusReportFrequency: metav1.Duration{Duration: 10 * time.Second},
	}
	if c.opts.KubeletConfig != nil {
		c.opts.KubeletConfig(kc)
	}
	data, err := json.MarshalIndent(kc, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600)
}

// waitNode initialises the node the way a cloud provider would (address
// 127.0.0.1, the uninitialized taint removed) and waits until it is Ready,
// schedulable and, when since is set, its kubelet has renewed the node's
// lease since then.
func (c *Cluster) waitNode(timeout time.Duration, since time.Time) error {
	err := harness.WaitFor(timeout, func() error {
		if err := c.kubelet.checkRunning(); err != nil {
			return harness.Permanent(err)
		}
		if err := httpOK(fmt.Sprintf("http://127.0.0.1:%d/healthz", c.healthzPort), nil); err != nil {
			return fmt.Errorf("kubelet healthz: %w", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		nodes := c.Client.CoreV1().Nodes()
		node, err := nodes.Get(ctx, c.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !hasInternalIP(node) {
			node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"},
				{Type: corev1.NodeHostName, Address: c.NodeName}}
			if _, err := nodes.UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("set the node's address: %w", err)
			}
			return errors.New("node address just set")
		}
		var taints []corev1.Taint
		for _, tn := range node.Spec.Taints {
			if tn.Key != uninitializedTaint {
				taints = append(taints, tn)
			}
		}
		if len(taints) != len(node.Spec.Taints) {
			node.Spec.Taints = taints
			if _, err := nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("remove the %s taint: %w", uninitializedTaint, err)
			}
			return errors.New("taint just removed")
		}
		ready := false
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status != corev1.ConditionTrue {
					return fmt.Errorf("node not Ready: %s: %s", cond.Reason, cond.Message)
				}
				ready = true
			}
		}
		if !ready {
			return errors.New("node has no Ready condition")
		}
		if !since.IsZero() {
			// The node's lease (microseconds) says that this kubelet has
			// reported, not the one before.
			lease, err := c.Client.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, c.NodeName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if lease.Spec.RenewTime == nil || lease.Spec.RenewTime.Time.Before(since) {
				return fmt.Errorf("node lease renewed at %v, before the kubelet started at %v", lease.Spec.RenewTime, since)
			}
		}
		for _, tn := range node.Spec.Taints {
			if tn.Effect == corev1.TaintEffectNoSchedule || tn.Effect == corev1.TaintEffectNoExecute {
				return fmt.Errorf("node tainted %s:%s", tn.Key, tn.Effect)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("node %q: %w", c.NodeName, err)
	}
	return nil
}

func hasInternalIP(node *corev1.Node) bool {
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP && a.Address == "127.0.0.1" {
			return true
		}
	}
	return false
}

// RestartKubelet stops the kubelet (SIGTERM) and starts it again with the
// same flags and state; pods and their containers keep running. It
// returns once the node is Ready again and the new kubelet has renewed
// the node's lease.
func (c *Cluster) RestartKubelet(t testing.TB) {
	t.Helper()
	c.kubeletMu.Lock()
	defer c.kubeletMu.Unlock()
	start := time.Now()
	if err := c.kubelet.stop(30 * time.Second); err != nil {
		t.Fatalf("k8s: stop the kubelet: %v", err)
	}
	since := time.Now()
	if err := c.kubelet.start(); err != nil {
		t.Fatalf("k8s: %v", err)
	}
	if err := c.waitNode(2*time.Minute, since); err != nil {
		t.Fatalf("k8s: after the kubelet restart: %v", err)
	}
	c.logf("kubelet restarted in %v", time.Since(start).Round(time.Millisecond))
}

// KubeletRunning reports whether the kubelet process runs.
func (c *Cluster) KubeletRunning() bool { return c.kubelet.running() }

// KubeletLog is the kubelet's whole log, restarts included.
func (c *Cluster) KubeletLog() string { return readLog(c.kubelet) }

// ContainerdLog is containerd's whole log.
func (c *Cluster) ContainerdLog() string { return readLog(c.containerd) }

func readLog(p *component) string {
	if p == nil {
		return ""
	}
	data, _ := os.ReadFile(p.log)
	return string(data)
}

// NodeKubeconfig is the kubelet's own kubeconfig (user
// system:node:<NodeName>, group system:nodes): node-scoped credentials,
// bound by the Node authorizer and NodeRestriction, for a node agent.
func (c *Cluster) NodeKubeconfig() string { return c.nodeConfig }

// UserKubeconfig writes a kubeconfig with a client certificate for user
// in groups (signed by the cluster CA) and returns its path.
func (c *Cluster) UserKubeconfig(t testing.TB, user string, groups ...string) string {
	t.Helper()
	c.kubeconfigNo++
	name := fmt.Sprintf("user-%d", c.kubeconfigNo)
	cert, err := c.pki.issue(name, certSpec{cn: user, orgs: groups})
	if err != nil {
		t.Fatalf("k8s: %v", err)
	}
	path := filepath.Join(c.Dir, "kubeconfig", name+".conf")
	if err := writeKubeconfig(path, c.APIServerURL, c.CACertPEM, user, &cert, ""); err != nil {
		t.Fatalf("k8s: %v", err)
	}
	return path
}

// PodServiceAccountKubeconfig writes a kubeconfig with a token
// (TokenRequest, valid one hour) of the pod's ServiceAccount, bound to the
// pod as the kubelet's tokens are: valid while the pod exists, and naming
// the pod's node (authentication.kubernetes.io/node-name). It returns its
// path.
func (c *Cluster) PodServiceAccountKubeconfig(t testing.TB, pod *corev1.Pod) string {
	t.Helper()
	return c.serviceAccountKubeconfig(t, pod.Namespace, pod.Spec.ServiceAccountName,
		&authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID})
}

func (c *Cluster) serviceAccountKubeconfig(t testing.TB, ns, name string, bound *authenticationv1.BoundObjectReference) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	exp := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp, BoundObjectRef: bound}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("k8s: token of ServiceAccount %s/%s: %v", ns, name, err)
	}
	c.kubeconfigNo++
	path := filepath.Join(c.Dir, "kubeconfig", fmt.Sprintf("sa-%d.conf", c.kubeconfigNo))
	if err := writeKubeconfig(path, c.APIServerURL, c.CACertPEM, "system:serviceaccount:"+ns+":"+name, nil, tr.Status.Token); err != nil {
		t.Fatalf("k8s: %v", err)
	}
	return path
}

// ClientFor is a clientset for a kubeconfig (UserKubeconfig, ...).
func ClientFor(t testing.TB, kubeconfig string) kubernetes.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatalf("k8s: %v", err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("k8s: %v", err)
	}
	return cs
}

// ImportImage imports an image tarball (OCI layout or docker-archive)
// into the CRI's image store (ctr -n k8s.io images import).
func (c *Cluster) ImportImage(t testing.TB, tarPath string) {
	t.Helper()
	if err := c.importImage(tarPath); err != nil {
		t.Fatalf("k8s: %v", err)
	}
}

func (c *Cluster) importImage(tarPath string) error {
	_, err := c.ctr(2*time.Minute, "images", "import", tarPath)
	return err
}

// Stop tears the cluster down (t.Cleanup calls it; calling it earlier is
// fine, it runs once): pods are deleted, the kubelet stopped, the
// containers it left killed and removed, then containerd, the scheduler,
// the controller-manager, the apiserver and etcd are stopped, what is
// mounted under Dir and KubeletRootDir unmounted, the pod bridge, the
// kubepods cgroups and the kubelet's host directories removed and its
// sysctls put back. If the test failed, the tails of every component's
// log are t.Logged first. Dir is kept when $MGPU_K8S_KEEP is set.
func (c *Cluster) Stop(t testing.TB) {
	t.Helper()
	c.stopOnce.Do(func() {
		for _, err := range c.stop() {
			t.Errorf("k8s: teardown: %v", err)
		}
		if t.Failed() {
			c.logTails(t)
		}
		if c.Dir != "" && os.Getenv("MGPU_K8S_KEEP") == "" {
			unmountUnder(c.Dir)
			if err := os.RemoveAll(c.Dir); err != nil {
				t.Errorf("k8s: teardown: %v", err)
			}
		} else if c.Dir != "" {
			t.Logf("k8s: kept %s ($MGPU_K8S_KEEP)", c.Dir)
		}
		if c.host.lockFile != nil {
			_ = c.host.lockFile.Close()
		}
	})
}

func (c *Cluster) stop() []error {
	var errs []error
	c.kubeletMu.Lock()
	defer c.kubeletMu.Unlock()
	if c.kubelet.running() && c.apiserver.running() {
		if err := c.deletePods(30 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.kubelet.stop(20 * time.Second); err != nil {
		errs = append(errs, err)
	}
	if c.containerd.running() {
		if err := c.removeContainers(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.containerd.stop(20 * time.Second); err != nil {
		errs = append(errs, err)
	}
	if c.Dir != "" {
		// Shims whose containerd is gone, with their containers.
		killProcessesMatching(c.Dir)
	}
	for _, p := range []*component{c.scheduler, c.ctrlManager, c.apiserver, c.etcd} {
		if err := p.stop(20 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	if c.Dir != "" {
		unmountUnder(c.Dir)
	}
	if err := deleteLink(PodBridge); err != nil {
		errs = append(errs, err)
	}
	if c.podLogsDir != "" && !c.host.created[containerLogLinks] {
		removeLinksInto(containerLogLinks, c.podLogsDir)
	}
	errs = append(errs, releaseHost(&c.host)...)
	return errs
}

// deletePods deletes every pod (grace one second) and waits until the
// kubelet has stopped them all.
func (c *Cluster) deletePods(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	pods, err := c.Client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list pods: %w", err)
	}
	grace := int64(1)
	for _, p := range pods.Items {
		err := c.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
	return harness.WaitFor(timeout, func() error {
		pods, err := c.Client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if n := len(pods.Items); n > 0 {
			return fmt.Errorf("%d pods left, e.g. %s/%s", n, pods.Items[0].Namespace, pods.Items[0].Name)
		}
		return nil
	})
}

func (c *Cluster) logTails(t testing.TB) {
	t.Helper()
	for _, p := range []*component{c.etcd, c.apiserver, c.ctrlManager, c.scheduler, c.containerd, c.kubelet} {
		if p == nil {
			continue
		}
		n := 4000
		if p == c.kubelet || p == c.containerd {
			n = 12000
		}
		t.Logf("k8s: --- %s, the end of %s:\n%s", p.name, p.log, tail(p.log, n))
	}
}

// Leftovers lists what of the cluster is still on the host after Stop:
// processes naming its directory, mounts under it or KubeletRootDir,
// processes in kubepods cgroups, the pod bridge, KubeletRootDir itself.
// It is empty after a clean teardown.
func (c *Cluster) Leftovers() []string {
	var out []string
	for _, p := range processesMatching(c.Dir) {
		out = append(out, "process "+p)
	}
	for _, d := range []string{c.Dir, KubeletRootDir} {
		for _, m := range mountsUnder(d) {
			out = append(out, "mount "+m)
		}
	}
	for _, m := range cgroupMounts() {
		for _, pid := range cgroupProcs(filepath.Join(m, "kubepods")) {
			out = append(out, "process "+strconv.Itoa(pid)+" in "+filepath.Join(m, "kubepods"))
		}
	}
	if linkExists(PodBridge) {
		out = append(out, "link "+PodBridge)
	}
	if _, err := os.Stat(KubeletRootDir); err == nil {
		out = append(out, "directory "+KubeletRootDir)
	}
	return out
}

// removeLinksInto removes the symbolic links in dir that point below target.
func removeLinksInto(dir, target string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		if dst, err := os.Readlink(p); err == nil && strings.HasPrefix(dst, target+"/") {
			_ = os.Remove(p)
		}
	}
}

// freePorts picks n distinct free TCP ports on 127.0.0.1.
func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// httpOK GETs url and wants 200.
func httpOK(url string, client *http.Client) error {
	if client == nil {
		client = &http.Client{Timeout: 5 * time.Second}
	}
	resp, err := client.Get(url) //nolint:noctx // bounded by the client's timeout
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	return nil
}

func envWithout(env []string, key string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, key+"=") {
			out = append(out, kv)
		}
	}
	return out
}
