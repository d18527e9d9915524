package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The podman test runs real containers with the spec `mgpu-cli cdi generate`
// writes for a simulated node, and checks what the container gets: the GPU's
// device node, the control node, the shim and /etc/ld.so.preload, the
// device's client/ directory (read-only, a socket in it reachable also
// after it was recreated) and nothing else of the run directory.
//
// Podman 4.3 (Debian 12) reads CDI specs only from /etc/cdi and
// /var/run/cdi, so the test writes its spec to /var/run/cdi under a kind of
// its own (mgpu.io/gpu-e2e-<pid>) that no installed spec can clash with,
// and removes it afterwards.

// podmanRepoRoot is the module root, two levels up from test/e2e.
func podmanRepoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root not found: %v", err)
	}
	return root
}

func podmanRequire(t *testing.T) string {
	t.Helper()
	if InstalledFromEnv() != "" {
		// These check the spec's edits with binaries built from the source
		// tree; the installed package's run covers the Node-based tests.
		t.Skip("MGPU_E2E_INSTALLED: this test builds from the source tree")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: podman runs rootful containers with device nodes (run test/e2e/deps.sh, then go test as root)")
	}
	p, err := exec.LookPath("podman")
	if err != nil {
		t.Skip("podman not installed (run test/e2e/deps.sh)")
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("/bin/busybox missing: install busybox-static (test/e2e/deps.sh)")
	}
	return p
}

func podmanRun(t *testing.T, timeout time.Duration, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...) //nolint:gosec // test commands
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("%s timed out after %s: %w", name, timeout, ctx.Err())
	}
	return out.String(), err
}

// podmanRootfs builds a minimal root filesystem: Debian's static busybox
// and the static dial helper.
func podmanRootfs(t *testing.T, root, dir string) {
	t.Helper()
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "busybox"), data, 0o755); err != nil { //nolint:gosec // an executable
		t.Fatal(err)
	}
	for _, app := range []string{"sh", "cat", "ls", "stat", "test", "touch", "grep", "env", "echo"} {
		if err := os.Symlink("busybox", filepath.Join(bin, app)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("go", "build", "-o", filepath.Join(bin, "dial"), "./test/e2e/testdata/dial")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build dial: %v\n%s", err, out)
	}
}

// podmanShim builds the real shim into prefix/lib/mgpu.
func podmanShim(t *testing.T, root, prefix, build string) {
	t.Helper()
	lib := filepath.Join(build, "lib", "libmgpu-shim.so")
	cmd := exec.Command("make", "-s", "-C", filepath.Join(root, "enforcer", "shim"), "BUILD="+build, lib)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the shim: %v\n%s", err, out)
	}
	data, err := os.ReadFile(lib) //nolint:gosec // test build output
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(prefix, "lib", "mgpu")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "libmgpu-shim.so"), data, 0o755); err != nil { //nolint:gosec // a shared library
		t.Fatal(err)
	}
}

// podmanServe listens on sock and answers the first connection with first;
// then it removes the socket and listens anew, as a restarted enforcer does,
// and answers the next one with second.
func podmanServe(t *testing.T, sock, first, second string) <-chan error {
	t.Helper()
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		answer := func(l net.Listener, msg string) error {
			defer func() { _ = l.Close() }()
			c, err := l.Accept()
			if err != nil {
				return err
			}
			defer func() { _ = c.Close() }()
			_, err = c.Write([]byte(msg))
			return err
		}
		if err := answer(l, first); err != nil {
			done <- err
			return
		}
		_ = os.Remove(sock)
		l2, err := net.Listen("unix", sock)
		if err != nil {
			done <- err
			return
		}
		done <- answer(l2, second)
	}()
	t.Cleanup(func() { _ = l.Close() })
	return done
}

func TestPodmanCDI(t *testing.T) {
	podman := podmanRequire(t)
	root := podmanRepoRoot(t)
	tmp := t.TempDir()
	if err := os.Chmod(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	kind := fmt.Sprintf("mgpu.io/gpu-e2e-%d", os.Getpid())
	run, prefix, rootfs := filepath.Join(tmp, "run"), filepath.Join(tmp, "prefix"), filepath.Join(tmp, "rootfs")

	cli := filepath.Join(tmp, "mgpu-cli")
	build := exec.Command("go", "build", "-o", cli, "./cmd/mgpu-cli")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build mgpu-cli: %v\n%s", err, out)
	}
	podmanRootfs(t, root, rootfs)
	podmanShim(t, root, prefix, filepath.Join(tmp, "build"))

	cfg := filepath.Join(tmp, "config.toml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, `version = 1
backend = "sim"
run_dir = %q
prefix = %q
cdi_kind = %q
cdi_spec_dir = "/var/run/cdi"

[[sim.gpu]]
name = "Simulated-GPU-80GB"
memory_mib = 81920
[[sim.gpu]]
name = "Simulated-GPU-80GB"
memory_mib = 81920
`, run, prefix, kind), 0o644); err != nil {
		t.Fatal(err)
	}
	specFile := "/var/run/cdi/" + strings.ReplaceAll(kind, "/", "-") + ".yaml"
	t.Cleanup(func() { _ = os.Remove(specFile) })

	out, err := podmanRun(t, time.Minute, cli, "--config", cfg, "cdi", "generate", "--no-hooks")
	if err != nil {
		t.Fatalf("cdi generate: %v\n%s", err, out)
	}
	t.Logf("%s", out)
	if !strings.Contains(out, "wrote "+specFile) {
		t.Fatalf("cdi generate did not write %s: %s", specFile, out)
	}
	// The run directory as the enforcers make it: the tests must not see
	// control.sock or regions/.
	for i := 0; i < 2; i++ {
		gpu := filepath.Join(run, fmt.Sprintf("gpu%d", i))
		for _, d := range []string{"client", "regions"} {
			if err := os.MkdirAll(filepath.Join(gpu, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(gpu, "control.sock"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	out, err = podmanRun(t, time.Minute, cli, "--config", cfg, "cdi", "list", "--kind", kind, "0")
	if err != nil || !strings.Contains(out, kind+"=0") || !strings.Contains(out, filepath.Join(run, "gpu0", "client")) {
		t.Fatalf("cdi list: %v\n%s", err, out)
	}

	podmanArgs := func(device string, script string) []string {
		return []string{"run", "--rm", "--device", device,
			"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
			"--network", "none", "--rootfs", rootfs, "/bin/sh", "-c", script}
	}
	client0 := filepath.Join(run, "gpu0", "client")
	sock := filepath.Join(client0, "client.sock")
	served := podmanServe(t, sock, "first enforcer\n", "restarted enforcer\n")

	script := strings.Join([]string{
		`stat -c "node %F %t:%T %n" /dev/nvidia*`,
		`echo "preload $(cat /etc/ld.so.preload)"`,
		`stat -c "shim %s %n" ` + filepath.Join(prefix, "lib", "mgpu", "libmgpu-shim.so"),
		`env | grep ^MGPU_ | sed 's/^/env /'`,
		`echo "gpu0 $(ls -A ` + filepath.Join(run, "gpu0") + `)"`,
		`echo "run $(ls -A ` + run + `)"`,
		`grep -o " ` + run + `[^ ]*" /proc/mounts | sed 's/^ /mount /'`,
		`touch ` + filepath.Join(client0, "x") + ` 2>/dev/null && echo "client writable" || echo "client read-only"`,
		`echo "dial $(dial ` + sock + `)"`,
		`echo "redial $(dial -retry 30s ` + sock + `)"`,
	}, "; ")
	out, err = podmanRun(t, 2*time.Minute, podman, podmanArgs(kind+"=0", script)...)
	t.Logf("podman run --device %s=0:\n%s", kind, out)
	if err != nil {
		t.Fatalf("podman run: %v", err)
	}
	if err := <-served; err != nil {
		t.Errorf("client socket server: %v", err)
	}
	shimSize := func() int64 {
		st, err := os.Stat(filepath.Join(prefix, "lib", "mgpu", "libmgpu-shim.so"))
		if err != nil {
			t.Fatal(err)
		}
		return st.Size()
	}()
	for _, want := range []string{
		"node character special file 1:3 /dev/nvidia0\n",
		"node character special file 1:3 /dev/nvidiactl\n",
		"preload " + filepath.Join(prefix, "lib", "mgpu", "libmgpu-shim.so") + "\n",
		fmt.Sprintf("shim %d %s\n", shimSize, filepath.Join(prefix, "lib", "mgpu", "libmgpu-shim.so")),
		"env MGPU_RUN_DIR=" + run + "\n",
		"env MGPU_DEVICE_0=GPU-5a1e0000-0000-4000-8000-000000000000\n",
		"gpu0 client\n", // no control.sock, no regions/
		"run gpu0\n",    // no gpu1, no sim/
		"mount " + client0 + "\n",
		"client read-only\n",
		"dial first enforcer\n",
		"redial restarted enforcer\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("container output lacks %q", want)
		}
	}
	if strings.Count(out, "mount ") != 1 || strings.Contains(out, "/dev/nvidia1") || strings.Contains(out, "MGPU_DEVICE_1") {
		t.Errorf("the container got GPU 1 too")
	}

	// By UUID, and all: the same edits for the UUID's GPU, every GPU for all.
	out, err = podmanRun(t, 2*time.Minute, podman, podmanArgs(kind+"=GPU-5a1e0000-0000-4000-8000-000000000001",
		`ls /dev/ | grep nvidia; env | grep ^MGPU_DEVICE; grep -o " `+run+`[^ ]*" /proc/mounts`)...)
	if err != nil {
		t.Fatalf("podman run by UUID: %v\n%s", err, out)
	}
	if got, want := out, "nvidia1\nnvidiactl\nMGPU_DEVICE_1=GPU-5a1e0000-0000-4000-8000-000000000001\n "+run+"/gpu1/client\n"; got != want {
		t.Errorf("by UUID: got %q, want %q", got, want)
	}
	out, err = podmanRun(t, 2*time.Minute, podman, podmanArgs(kind+"=all",
		`ls /dev/ | grep nvidia; env | grep ^MGPU_DEVICE | sort; grep -o " `+run+`[^ ]*" /proc/mounts`)...)
	if err != nil {
		t.Fatalf("podman run all: %v\n%s", err, out)
	}
	if got, want := out, "nvidia0\nnvidia1\nnvidiactl\nMGPU_DEVICE_0=GPU-5a1e0000-0000-4000-8000-000000000000\nMGPU_DEVICE_1=GPU-5a1e0000-0000-4000-8000-000000000001\n "+
		run+"/gpu0/client\n "+run+"/gpu1/client\n"; got != want {
		t.Errorf("all: got %q, want %q", got, want)
	}

	// An unknown device: podman refuses to start the container.
	out, err = podmanRun(t, time.Minute, podman, podmanArgs(kind+"=7", "true")...)
	if err == nil || !strings.Contains(out, kind+"=7") {
		t.Errorf("unknown device: err = %v, output %q; want a refusal naming it", err, out)
	}
}

// With hooks, the spec makes podman run mgpu-hook from the prefix: here it
// is not installed, so the container must not start, and podman says why.
func TestPodmanCDIHooksRun(t *testing.T) {
	podman := podmanRequire(t)
	root := podmanRepoRoot(t)
	tmp := t.TempDir()
	if err := os.Chmod(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	kind := fmt.Sprintf("mgpu.io/gpu-e2e-hooks-%d", os.Getpid())
	run, prefix, rootfs := filepath.Join(tmp, "run"), filepath.Join(tmp, "prefix"), filepath.Join(tmp, "rootfs")
	cli := filepath.Join(tmp, "mgpu-cli")
	build := exec.Command("go", "build", "-o", cli, "./cmd/mgpu-cli")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build mgpu-cli: %v\n%s", err, out)
	}
	podmanRootfs(t, root, rootfs)
	if err := os.MkdirAll(filepath.Join(prefix, "lib", "mgpu"), 0o755); err != nil {
		t.Fatal(err)
	}
	// The hook is what must fail here; the mounts only need their sources.
	if err := os.WriteFile(filepath.Join(prefix, "lib", "mgpu", "libmgpu-shim.so"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(run, "gpu0", "client"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(tmp, "config.toml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, "version = 1\nbackend = \"sim\"\nrun_dir = %q\nprefix = %q\ncdi_kind = %q\n[[sim.gpu]]\n", run, prefix, kind), 0o644); err != nil {
		t.Fatal(err)
	}
	specFile := "/var/run/cdi/" + strings.ReplaceAll(kind, "/", "-") + ".yaml"
	t.Cleanup(func() { _ = os.Remove(specFile) })
	if out, err := podmanRun(t, time.Minute, cli, "--config", cfg, "cdi", "generate"); err != nil {
		t.Fatalf("cdi generate: %v\n%s", err, out)
	}
	out, err := podmanRun(t, 2*time.Minute, podman, "run", "--rm", "--device", kind+"=0",
		"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
		"--network", "none", "--rootfs", rootfs, "/bin/sh", "-c", "echo started")
	t.Logf("podman run with hooks:\n%s", out)
	if err == nil || strings.Contains(out, "started") {
		t.Fatalf("the container started although the createRuntime hook %s is missing", filepath.Join(prefix, "bin", "mgpu-hook"))
	}
	if !strings.Contains(out, filepath.Join(prefix, "bin", "mgpu-hook")) && !strings.Contains(out, "hook") {
		t.Errorf("podman's error does not point at the hook: %s", out)
	}
}
