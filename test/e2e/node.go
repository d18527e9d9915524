// Package e2e runs mgpu with real container engines: its own containerd 2.x
// (driven with ctr) and podman, both on Debian's runc, on a simulated GPU
// node. Containers get their GPU through the CDI spec `mgpu-cli cdi
// generate` writes, are admitted by the real mgpu-hook, attach through the
// real shim to the real enforcers, and run mgpu-workload against the
// simulated driver (test/fakecuda), whose busy-time records, attributed per
// pid namespace, give each container's achieved share.
//
// The test files hold the acceptance tests (docs/e2e.md); the exported part
// (Node, Containerd, the engines, HookBench) is for the tests and for the
// benchmark program.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// NodeOptions describes the simulated node.
type NodeOptions struct {
	Devices      int            // simulated GPUs (default 1)
	MemoryMiB    int64          // per GPU (default 16384)
	Policies     map[int]string // compute_policy per device (default fixed-share)
	MaxInstances int            // max_instances (0: the config default, 16)
	// OnlineOffline is every device's online_offline_switch (0: off).
	OnlineOffline int
	// Log receives the enforcers' output (default: discarded).
	Log io.Writer
	// Installed is an installation prefix (a package's: "/usr") whose
	// bin/mgpu-{cli,enforcer,hook} and lib/mgpu/ (the shim and its preload
	// file) the node uses in place of the build's: then only the test
	// fixtures (the simulated driver, fakecuda-ctl, mgpu-workload) come from
	// the build directory. Empty: everything from the build.
	Installed string
}

// InstalledFromEnv is NodeOptions.Installed as the tests take it:
// MGPU_E2E_INSTALLED (test/packaging sets it to run this suite on an
// installed package).
func InstalledFromEnv() string { return os.Getenv("MGPU_E2E_INSTALLED") }

// Node is a simulated GPU node laid out for containers: a configuration
// with private run, state and prefix directories, the hook and the shim
// staged under the prefix, the simulated driver's state directory, a root
// filesystem holding mgpu-workload and its libraries, and the enforcers.
// Close it.
type Node struct {
	Dir        string // temporary root of everything below
	ConfigPath string
	RunDir     string // run_dir
	StateDir   string // state_dir
	Prefix     string // prefix: bin/mgpu-hook, lib/mgpu/libmgpu-shim.so
	FakeState  string // FAKECUDA_STATE_DIR, mounted into containers at the same path
	IODir      string // mounted read-write at /e2e in containers: their output files
	Rootfs     string // the containers' root filesystem
	Build      string // the node's snapshot of the build directory (make build)
	CLI        string // mgpu-cli (of the snapshot, or the installed one)
	Enforcer   string // mgpu-enforcer (of the snapshot, or the installed one)
	Ctl        string // fakecuda-ctl of the snapshot

	opts  NodeOptions
	mu    sync.Mutex
	enf   harness.Enforcers
	specs []string
}

// NewNode builds the node's files from the build directory
// (fakecuda.BuildDir: $MGPU_BUILD or build/) and starts nothing; see
// StartEnforcer and GenerateSpec. It needs root (device nodes, later the
// containers).
func NewNode(opts NodeOptions) (n *Node, err error) {
	if opts.Devices == 0 {
		opts.Devices = 1
	}
	if opts.MemoryMiB == 0 {
		opts.MemoryMiB = 16384
	}
	build, err := fakecuda.BuildDir()
	if err != nil {
		return nil, err
	}
	n = &Node{Build: build, opts: opts}
	// The fixtures always come from the build; mgpu's own files from it
	// unless an installation is named.
	fromBuild := []string{"bin/fakecuda-ctl", "bin/mgpu-workload", "fakecuda/libcuda.so.1", "fakecuda/libnvidia-ml.so.1"}
	if opts.Installed == "" {
		fromBuild = append(fromBuild, "bin/mgpu-cli", "bin/mgpu-enforcer", "bin/mgpu-hook", "lib/libmgpu-shim.so")
	} else {
		for _, p := range []string{"bin/mgpu-cli", "bin/mgpu-enforcer", "bin/mgpu-hook", "lib/mgpu/libmgpu-shim.so", "lib/mgpu/ld.so.preload"} {
			if _, err := os.Stat(filepath.Join(opts.Installed, p)); err != nil {
				return nil, fmt.Errorf("e2e: the installation under %s lacks %s: %w", opts.Installed, p, err)
			}
		}
	}
	for _, p := range fromBuild {
		if _, err := os.Stat(filepath.Join(build, p)); err != nil {
			return nil, fmt.Errorf("e2e: %s is missing; run make build", filepath.Join(build, p))
		}
	}
	// Short paths: unix socket paths are limited to 108 bytes.
	if n.Dir, err = os.MkdirTemp("", "mgpu-e2e-"); err != nil {
		return nil, err
	}
	dir := n.Dir
	defer func() {
		if err != nil {
			_ = removeAll(dir) // n is nil by then
		}
	}()
	if err := os.Chmod(n.Dir, 0o755); err != nil { //nolint:gosec // containers traverse it
		return nil, err
	}
	n.RunDir = filepath.Join(n.Dir, "run")
	// The run directory is a tmpfs, as /run is on a node: the enforcers make
	// and remove their regions' files there at every container start and
	// exit, and the journal of the disk filesystem under /tmp is no part of
	// what that costs on a node (make bench's hook section). Without root it
	// stays a plain directory. Close detaches it with the rest.
	if os.Geteuid() == 0 {
		if err := os.Mkdir(n.RunDir, 0o755); err != nil { //nolint:gosec // as /run/mgpu
			return nil, err
		}
		if err := syscall.Mount("tmpfs", n.RunDir, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV, "mode=0755"); err != nil {
			return nil, fmt.Errorf("e2e: mount a tmpfs on %s: %w", n.RunDir, err)
		}
	}
	n.StateDir = filepath.Join(n.Dir, "state")
	n.Prefix = filepath.Join(n.Dir, "prefix")
	n.FakeState = filepath.Join(n.Dir, "fakecuda")
	n.IODir = filepath.Join(n.Dir, "io")
	n.Rootfs = filepath.Join(n.Dir, "rootfs")
	dirs := []string{n.FakeState, n.IODir}
	if opts.Installed == "" {
		dirs = append(dirs, filepath.Join(n.Prefix, "bin"), filepath.Join(n.Prefix, "lib", "mgpu"))
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil { //nolint:gosec // shared with containers
			return nil, err
		}
	}
	// The state dir and the output dir are written from containers.
	for _, d := range []string{n.FakeState, n.IODir} {
		if err := os.Chmod(d, 0o777); err != nil { //nolint:gosec // shared with containers
			return nil, err
		}
	}
	// A snapshot of the build, so that a rebuild of build/ while the node
	// runs cannot mix two builds (the simulated driver's state layout).
	snap := filepath.Join(n.Dir, "build")
	for _, p := range fromBuild {
		if err := copyFile(filepath.Join(build, p), filepath.Join(snap, p), 0o755); err != nil {
			return nil, err
		}
	}
	n.Build = snap
	n.Ctl = n.bin("fakecuda-ctl")
	if opts.Installed != "" {
		n.Prefix = opts.Installed
		n.CLI = filepath.Join(opts.Installed, "bin", "mgpu-cli")
		n.Enforcer = filepath.Join(opts.Installed, "bin", "mgpu-enforcer")
	} else {
		n.CLI, n.Enforcer = n.bin("mgpu-cli"), n.bin("mgpu-enforcer")
		if err := copyFile(n.bin("mgpu-hook"), filepath.Join(n.Prefix, "bin", "mgpu-hook"), 0o755); err != nil {
			return nil, err
		}
		if err := copyFile(filepath.Join(snap, "lib", "libmgpu-shim.so"), filepath.Join(n.Prefix, "lib", "mgpu", "libmgpu-shim.so"), 0o755); err != nil {
			return nil, err
		}
	}
	if err := BuildRootfs(n.Rootfs, snap, filepath.Join(n.Prefix, "lib", "mgpu", "libmgpu-shim.so")); err != nil {
		return nil, err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "version = 1\nbackend = \"sim\"\nrun_dir = %q\nstate_dir = %q\nprefix = %q\ncdi_spec_dir = %q\n\n[defaults]\n",
		n.RunDir, n.StateDir, n.Prefix, CDISpecDir)
	if opts.MaxInstances != 0 {
		fmt.Fprintf(&b, "max_instances = %d\n", opts.MaxInstances)
	}
	if opts.OnlineOffline != 0 {
		fmt.Fprintf(&b, "online_offline_switch = %d\n", opts.OnlineOffline)
	}
	for dev := 0; dev < opts.Devices; dev++ {
		if p, ok := opts.Policies[dev]; ok {
			fmt.Fprintf(&b, "\n[[device]]\nindex = %d\ncompute_policy = %q\n", dev, p)
		}
	}
	for dev := 0; dev < opts.Devices; dev++ {
		fmt.Fprintf(&b, "\n[[sim.gpu]]\nname = \"Simulated-GPU\"\nmemory_mib = %d\n", opts.MemoryMiB)
	}
	n.ConfigPath = filepath.Join(n.Dir, "config.toml")
	if err := os.WriteFile(n.ConfigPath, []byte(b.String()), 0o644); err != nil { //nolint:gosec // a test config
		return nil, err
	}
	env := append(append(os.Environ(), n.FakeEnv()...), "LD_LIBRARY_PATH="+filepath.Join(n.Build, "fakecuda"))
	n.enf = harness.Enforcers{Bin: n.Enforcer, Config: n.ConfigPath, Env: func() []string { return env }, Log: opts.Log, Client: n.Client}
	return n, nil
}

func (n *Node) bin(name string) string { return filepath.Join(n.Build, "bin", name) }

// CDISpecDir is where the node's CDI specs go: ctr and podman 4.3 read specs
// only from /etc/cdi and /var/run/cdi, so the specs get kinds of their own.
const CDISpecDir = "/var/run/cdi"

// FakeEnv is what a process needs to use the simulated GPU of the node
// (inside a container too: the libraries are in the root filesystem).
func (n *Node) FakeEnv() []string {
	return []string{
		"FAKECUDA_STATE_DIR=" + n.FakeState,
		"FAKECUDA_DEVICES=" + strconv.Itoa(n.opts.Devices),
		fmt.Sprintf("FAKECUDA_MEMORY_MIB=%d", n.opts.MemoryMiB),
	}
}

// GenerateSpec writes a CDI spec of the node under a new kind
// (mgpu.io/gpu-e2e-<pid>-<n>), with or without the hooks, and returns the
// kind. Close removes the spec file.
func (n *Node) GenerateSpec(hooks bool) (string, error) {
	n.mu.Lock()
	kind := fmt.Sprintf("mgpu.io/gpu-e2e-%d-%d", os.Getpid(), specSeq.Add(1))
	file := filepath.Join(CDISpecDir, strings.ReplaceAll(kind, "/", "-")+".yaml")
	n.specs = append(n.specs, file)
	n.mu.Unlock()
	args := []string{"--config", n.ConfigPath, "cdi", "generate", "--kind", kind, "--output", file}
	if !hooks {
		args = append(args, "--no-hooks")
	}
	out, err := run(context.Background(), time.Minute, nil, n.CLI, args...)
	if err != nil {
		return "", fmt.Errorf("e2e: mgpu-cli cdi generate: %w\n%s", err, out)
	}
	if n.opts.Installed != "" {
		// What the containers get must be the installation's files.
		data, err := os.ReadFile(file) //nolint:gosec // the spec just written
		if err != nil {
			return "", err
		}
		want := []string{filepath.Join(n.opts.Installed, "lib", "mgpu", "libmgpu-shim.so")}
		if hooks {
			want = append(want, filepath.Join(n.opts.Installed, "bin", "mgpu-hook"))
		}
		for _, w := range want {
			if !bytes.Contains(data, []byte(w)) {
				return "", fmt.Errorf("e2e: the CDI spec %s does not use the installed %s:\n%s", file, w, data)
			}
		}
	}
	return kind, nil
}

// StartEnforcer starts mgpu-enforcer for device dev and waits until its
// control socket answers.
func (n *Node) StartEnforcer(dev int) error { return n.enf.Start(dev) }

// KillEnforcer sends sig to device dev's enforcer and waits until it is
// gone.
func (n *Node) KillEnforcer(dev int, sig syscall.Signal) error { return n.enf.Stop(dev, sig) }

// Client is a control-API client of device dev.
func (n *Node) Client(dev int) *api.Client {
	return api.NewClient(api.ControlSocket(filepath.Join(n.RunDir, fmt.Sprintf("gpu%d", dev))))
}

// Instances runs `mgpu-cli instance list --output json` (every device).
func (n *Node) Instances() ([]api.Instance, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(n.CLI, "--config", n.ConfigPath, "instance", "list", "--output", "json") //nolint:gosec // the build's binary
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("mgpu-cli instance list: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	var list []api.Instance
	if err := json.Unmarshal(stdout.Bytes(), &list); err != nil {
		return nil, fmt.Errorf("mgpu-cli instance list: %w: %q", err, stdout.String())
	}
	return list, nil
}

// Stat reads the simulated devices' records.
func (n *Node) Stat() (fakecuda.State, error) { return fakecuda.StatWith(n.Ctl, n.FakeState) }

// Close stops the enforcers, removes the CDI specs and the node's files.
// Containers must be gone first (Engine.Cleanup).
func (n *Node) Close() error {
	n.mu.Lock()
	specs := n.specs
	n.specs = nil
	n.mu.Unlock()
	n.enf.Close()
	var errs []error
	for _, f := range specs {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, removeAll(n.Dir))
	return errors.Join(errs...)
}

// removeAll removes dir; bind-mount targets runc left in the root
// filesystem are plain directories and files, so this is os.RemoveAll,
// except that a leftover mount (a container killed mid-way) is detached
// first.
func removeAll(dir string) error {
	if err := os.RemoveAll(dir); err == nil {
		return nil
	}
	if data, err := os.ReadFile("/proc/self/mounts"); err == nil {
		lines := strings.Split(string(data), "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			f := strings.Fields(lines[i])
			if len(f) > 1 && strings.HasPrefix(f[1], dir+"/") {
				_ = syscall.Unmount(f[1], syscall.MNT_DETACH)
			}
		}
	}
	return os.RemoveAll(dir)
}

// PIDNamespace returns the inode of the pid namespace of host process pid.
func PIDNamespace(pid int) (uint64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/ns/pid", pid), &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// Poll polls cond every 10 ms until it returns nil, returns an error made
// by harness.Permanent, or timeout passes (harness.WaitFor).
func Poll(timeout time.Duration, cond func() error) error { return harness.WaitFor(timeout, cond) }

// run runs name with args (stdout and stderr together) under a timeout.
func run(ctx context.Context, timeout time.Duration, env []string, name string, args ...string) (string, error) {
	var out bytes.Buffer
	err := runTo(ctx, timeout, env, &out, &out, name, args...)
	return out.String(), err
}

// runStdout runs name with args and returns its stdout; stderr goes into
// the error.
func runStdout(ctx context.Context, timeout time.Duration, name string, args ...string) (string, error) {
	var out, stderr bytes.Buffer
	err := runTo(ctx, timeout, nil, &out, &stderr, name, args...)
	if err != nil {
		err = fmt.Errorf("%s %s: %w: %s", filepath.Base(name), strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out.String(), err
}

func runTo(ctx context.Context, timeout time.Duration, env []string, stdout, stderr io.Writer, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...) //nolint:gosec // test commands
	cmd.Stdout, cmd.Stderr = stdout, stderr
	if env != nil {
		cmd.Env = env
	}
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("%s timed out after %s: %w", filepath.Base(name), timeout, ctx.Err())
	}
	return err
}

func copyFile(src, dst string, mode os.FileMode) error {
	data, err := os.ReadFile(src) //nolint:gosec // build outputs and system libraries
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil { //nolint:gosec // a root filesystem
		return err
	}
	return os.WriteFile(dst, data, mode)
}
