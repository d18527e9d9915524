package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// ContainerdBinaries finds containerd, ctr and containerd-shim-runc-v2:
// $MGPU_CONTAINERD (the directory holding them, or containerd's path), the
// cache test/e2e/deps.sh fills ($MGPU_E2E_CACHE/bin, default
// /var/cache/mgpu-e2e/bin), then PATH. It returns the directory.
func ContainerdBinaries() (string, error) {
	var dirs []string
	if v := os.Getenv("MGPU_CONTAINERD"); v != "" {
		if st, err := os.Stat(v); err == nil && !st.IsDir() {
			v = filepath.Dir(v)
		}
		dirs = append(dirs, v)
	}
	cache := os.Getenv("MGPU_E2E_CACHE")
	if cache == "" {
		cache = "/var/cache/mgpu-e2e"
	}
	dirs = append(dirs, filepath.Join(cache, "bin"))
	if p, err := exec.LookPath("containerd"); err == nil {
		dirs = append(dirs, filepath.Dir(p))
	}
	for _, d := range dirs {
		ok := true
		for _, b := range []string{"containerd", "ctr", "containerd-shim-runc-v2"} {
			if st, err := os.Stat(filepath.Join(d, b)); err != nil || st.Mode()&0o111 == 0 {
				ok = false
			}
		}
		if ok {
			return d, nil
		}
	}
	return "", fmt.Errorf("containerd 2.x, ctr and containerd-shim-runc-v2 not found in %s (run test/e2e/deps.sh)", strings.Join(dirs, ", "))
}

// Containerd is a private containerd: its own root, state, sockets and
// config under one directory, so it never meets a containerd of the host.
// Its shims keep containerd's default socket directory
// (/run/containerd/s/<hash of address, namespace and id>), which cannot
// clash either.
type Containerd struct {
	Dir       string // root of its files
	Address   string // gRPC socket (ctr --address)
	Namespace string // containerd namespace the tests use
	Bin       string // directory of containerd, ctr, containerd-shim-runc-v2
	Log       string // containerd's log file

	cmd    *exec.Cmd
	exited chan struct{}
}

// StartContainerd starts containerd with the binaries of bin in dir and
// waits until it answers. The config enables nothing beyond the defaults
// except CRI's CDI spec directories (specDir); ctr applies CDI specs
// itself, from /etc/cdi and /var/run/cdi.
func StartContainerd(bin, dir, specDir string) (*Containerd, error) {
	c := &Containerd{Dir: dir, Address: filepath.Join(dir, "containerd.sock"), Bin: bin,
		Namespace: fmt.Sprintf("mgpu-e2e-%d", os.Getpid()), Log: filepath.Join(dir, "containerd.log"),
		exited: make(chan struct{})}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf(`version = 3
root = %q
state = %q

[grpc]
  address = %q

[ttrpc]
  address = %q

[debug]
  address = %q

[metrics]
  address = ""

[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = [%q]
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.Address, c.Address+".ttrpc",
		filepath.Join(dir, "debug.sock"), specDir)
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	logf, err := os.Create(c.Log)
	if err != nil {
		return nil, err
	}
	c.cmd = exec.Command(filepath.Join(bin, "containerd"), "--config", cfgPath) //nolint:gosec // the cached build
	// The shim and runc are found through PATH.
	c.cmd.Env = append(envWithout(os.Environ(), "PATH"), "PATH="+bin+":"+os.Getenv("PATH"))
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, err
	}
	go func() { _ = c.cmd.Wait(); _ = logf.Close(); close(c.exited) }()
	err = Poll(20*time.Second, func() error {
		select {
		case <-c.exited:
			return harness.Permanent(fmt.Errorf("containerd exited: %v; log %s:\n%s", c.cmd.ProcessState, c.Log, c.tail()))
		default:
		}
		_, err := c.Ctr(context.Background(), 5*time.Second, "version")
		return err
	})
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

// Ctr runs ctr against this containerd, in its namespace.
func (c *Containerd) Ctr(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	return run(ctx, timeout, nil, filepath.Join(c.Bin, "ctr"), append([]string{"--address", c.Address, "--namespace", c.Namespace}, args...)...)
}

// CtrStdout runs ctr and returns its stdout only (ctr warns on stderr).
func (c *Containerd) CtrStdout(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	return runStdout(ctx, timeout, filepath.Join(c.Bin, "ctr"), append([]string{"--address", c.Address, "--namespace", c.Namespace}, args...)...)
}

func (c *Containerd) tail() string {
	data, _ := os.ReadFile(c.Log)
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

func (c *Containerd) log() string {
	data, _ := os.ReadFile(c.Log)
	return string(data)
}

// Close kills and deletes every task and container of the namespace, stops
// containerd (SIGTERM, then SIGKILL after 10 s) and removes its directory.
func (c *Containerd) Close() error {
	var errs []error
	select {
	case <-c.exited:
	default:
		ctx := context.Background()
		if out, err := c.CtrStdout(ctx, 30*time.Second, "containers", "ls", "-q"); err == nil {
			for _, id := range strings.Fields(out) {
				_, _ = c.Ctr(ctx, 30*time.Second, "task", "rm", "-f", id)
				if out, err := c.Ctr(ctx, 30*time.Second, "containers", "rm", id); err != nil {
					errs = append(errs, fmt.Errorf("ctr containers rm %s: %w: %s", id, err, out))
				}
			}
		}
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.exited:
		case <-time.After(10 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.exited
		}
	}
	// A shim that was killed leaves its socket behind; the log names them.
	for _, sock := range shimSocketRe.FindAllString(c.log(), -1) {
		_ = os.Remove(strings.TrimPrefix(sock, "unix://"))
	}
	errs = append(errs, removeAll(c.Dir))
	return errors.Join(errs...)
}

// shimSocketRe matches the shim sockets containerd logs ("connecting to
// shim ... address=unix:///run/containerd/s/<hash>").
var shimSocketRe = regexp.MustCompile(`unix:///run/containerd/s/[0-9a-f]{64}`)

// LogTail is the end of containerd's log (for failure reports).
func (c *Containerd) LogTail(w io.Writer) { _, _ = io.WriteString(w, c.tail()) }

func envWithout(env []string, key string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, key+"=") {
			out = append(out, kv)
		}
	}
	return out
}
