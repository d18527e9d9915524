package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// DockerBinaries finds dockerd and the docker CLI: dockerd from
// $MGPU_DOCKERD (its path, or the directory holding it), the cache
// test/e2e/deps.sh fills ($MGPU_E2E_CACHE/bin, default
// /var/cache/mgpu-e2e/bin), then PATH; docker from PATH.
func DockerBinaries() (dockerd, cli string, err error) {
	var cands []string
	if v := os.Getenv("MGPU_DOCKERD"); v != "" {
		if st, err := os.Stat(v); err == nil && st.IsDir() {
			v = filepath.Join(v, "dockerd")
		}
		cands = append(cands, v)
	}
	cands = append(cands, filepath.Join(e2eCache(), "bin", "dockerd"))
	if p, err := exec.LookPath("dockerd"); err == nil {
		cands = append(cands, p)
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			dockerd = c
			break
		}
	}
	if dockerd == "" {
		return "", "", fmt.Errorf("dockerd not found in %s (run test/e2e/deps.sh)", strings.Join(cands, ", "))
	}
	if cli, err = exec.LookPath("docker"); err != nil {
		return "", "", errors.New("the docker CLI is not on PATH (run test/e2e/deps.sh)")
	}
	return dockerd, cli, nil
}

func e2eCache() string {
	if c := os.Getenv("MGPU_E2E_CACHE"); c != "" {
		return c
	}
	return "/var/cache/mgpu-e2e"
}

// DockerEngine is a private Docker engine: its own data root, exec root,
// socket, pid file and daemon.json under one directory, with no network
// set-up (no bridge, no iptables), so it never meets a Docker of the host.
// It starts its own containerd (containerd 2.x from the same cache as the
// ctr engine's, found through PATH) and runs containers with runc. Its
// daemon.json is what `mgpu-cli runtime configure --runtime docker` writes.
type DockerEngine struct {
	Dir   string // root of its files
	Host  string // docker -H
	CLI   string // the docker CLI
	Log   string // dockerd's log
	Image string // the node's root filesystem, imported

	cmd    *exec.Cmd
	exited chan struct{}
}

// StartDocker configures and starts dockerd in dir, waits until it
// answers, and imports the node's root filesystem as an image. cdBin holds
// containerd and containerd-shim-runc-v2.
func StartDocker(n *Node, dockerd, cli, cdBin, dir string) (*DockerEngine, error) {
	d := &DockerEngine{Dir: dir, Host: "unix://" + filepath.Join(dir, "docker.sock"), CLI: cli,
		Log: filepath.Join(dir, "dockerd.log"), Image: fmt.Sprintf("mgpu-e2e-rootfs:%d", os.Getpid()),
		exited: make(chan struct{})}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	// Debian 12's runc (1.1) knows no time namespace, which moby v2 gives
	// every container by default: the engine is told not to. That key is
	// the file's before the command runs, which must keep it.
	conf := filepath.Join(dir, "daemon.json")
	if err := os.WriteFile(conf, []byte(`{"features": {"time-namespaces": false}}`+"\n"), 0o600); err != nil {
		return nil, err
	}
	if out, err := run(context.Background(), time.Minute, nil, n.CLI, "--config", n.ConfigPath,
		"runtime", "configure", "--runtime", "docker", "--config-file", conf); err != nil {
		return nil, fmt.Errorf("mgpu-cli runtime configure --runtime docker: %w\n%s", err, out)
	}
	data, err := os.ReadFile(conf) //nolint:gosec // the test's own file
	if err != nil {
		return nil, err
	}
	if !strings.Contains(string(data), `"time-namespaces": false`) || !strings.Contains(string(data), `"cdi": true`) {
		return nil, fmt.Errorf("mgpu-cli runtime configure --runtime docker: %s lost a key or lacks CDI:\n%s", conf, data)
	}
	logf, err := os.Create(d.Log)
	if err != nil {
		return nil, err
	}
	// exec-root holds containerd's socket: a short path (108-byte limit).
	d.cmd = exec.Command(dockerd, "--config-file", conf, //nolint:gosec // the cached build
		"--data-root", filepath.Join(dir, "data"), "--exec-root", filepath.Join(dir, "x"),
		"--pidfile", filepath.Join(dir, "dockerd.pid"), "-H", d.Host,
		"--iptables=false", "--ip6tables=false", "--bridge=none", "--userland-proxy=false")
	d.cmd.Env = append(envWithout(os.Environ(), "PATH"), "PATH="+cdBin+":"+os.Getenv("PATH"))
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, err
	}
	go func() { _ = d.cmd.Wait(); _ = logf.Close(); close(d.exited) }()
	err = Poll(60*time.Second, func() error {
		select {
		case <-d.exited:
			return harness.Permanent(fmt.Errorf("dockerd exited: %v; log %s:\n%s", d.cmd.ProcessState, d.Log, d.tail()))
		default:
		}
		_, err := d.Docker(context.Background(), 5*time.Second, "version")
		return err
	})
	if err == nil {
		err = d.importRootfs(n.Rootfs)
	}
	if err != nil {
		_ = d.Close()
		return nil, err
	}
	return d, nil
}

// importRootfs makes the image the containers run: Docker has no --rootfs,
// and there is no registry to pull from.
func (d *DockerEngine) importRootfs(rootfs string) error {
	tarball := filepath.Join(d.Dir, "rootfs.tar")
	if out, err := run(context.Background(), time.Minute, nil, "tar", "-C", rootfs, "-cf", tarball, "."); err != nil {
		return fmt.Errorf("tar %s: %w\n%s", rootfs, err, out)
	}
	defer os.Remove(tarball) //nolint:errcheck // the directory goes with Close
	if out, err := d.Docker(context.Background(), 2*time.Minute, "import", tarball, d.Image); err != nil {
		return fmt.Errorf("docker import: %w\n%s", err, out)
	}
	return nil
}

// Docker runs the docker CLI against this engine.
func (d *DockerEngine) Docker(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	return run(ctx, timeout, nil, d.CLI, append([]string{"-H", d.Host}, args...)...)
}

// DockerStdout runs the docker CLI and returns its stdout only.
func (d *DockerEngine) DockerStdout(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	return runStdout(ctx, timeout, d.CLI, append([]string{"-H", d.Host}, args...)...)
}

func (d *DockerEngine) tail() string {
	data, _ := os.ReadFile(d.Log)
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

// LogTail is the end of dockerd's log (for failure reports).
func (d *DockerEngine) LogTail() string { return d.tail() }

// Close removes every container, stops dockerd (SIGTERM, then SIGKILL
// after 15 s; it stops its containerd) and removes its directory.
func (d *DockerEngine) Close() error {
	var errs []error
	select {
	case <-d.exited:
	default:
		ctx := context.Background()
		if out, err := d.DockerStdout(ctx, 30*time.Second, "ps", "-aq"); err == nil {
			for _, id := range strings.Fields(out) {
				if out, err := d.Docker(ctx, time.Minute, "rm", "-f", id); err != nil {
					errs = append(errs, fmt.Errorf("docker rm -f %s: %w: %s", id, err, out))
				}
			}
		}
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-d.exited:
		case <-time.After(15 * time.Second):
			_ = d.cmd.Process.Kill()
			<-d.exited
		}
	}
	errs = append(errs, removeAll(d.Dir))
	return errors.Join(errs...)
}

// Docker runs containers with the docker CLI on a DockerEngine. The
// request goes in as environment variables (MGPU_*), or with Annotations
// as `--annotation vke.volcengine.com/mgpu-*` (Docker 24+).
type Docker struct {
	N           *Node
	E           *DockerEngine
	Annotations bool
	tracked
}

// Name is "docker", or "docker-annotations".
func (e *Docker) Name() string {
	if e.Annotations {
		return "docker-annotations"
	}
	return "docker"
}

func (e *Docker) runArgs(c Container, mode ...string) []string {
	args := append([]string{"run"}, mode...)
	args = append(args, "--name", c.ID, "--network", "none", "--ulimit", "nofile=1024:1024")
	for _, d := range c.Devices {
		args = append(args, "--device", c.Kind+"="+d)
	}
	for k, v := range c.request() {
		if e.Annotations {
			args = append(args, "--annotation", "vke.volcengine.com/mgpu-"+k+"="+v)
		} else {
			args = append(args, "-e", envKey[k]+"="+v)
		}
	}
	for _, kv := range e.N.containerEnv(c) {
		args = append(args, "-e", kv)
	}
	args = append(args, "-v", e.N.FakeState+":"+e.N.FakeState+":rw", "-v", e.N.IODir+":/e2e:rw", e.E.Image)
	return append(args, c.Args...)
}

// Run is `docker run --rm`.
func (e *Docker) Run(ctx context.Context, c Container) (string, error) {
	e.track(c.ID)
	return e.E.Docker(ctx, engineTimeout, e.runArgs(c, "--rm")...)
}

// Start is `docker run -d`.
func (e *Docker) Start(ctx context.Context, c Container) (string, error) {
	e.track(c.ID)
	return e.E.Docker(ctx, engineTimeout, e.runArgs(c, "-d")...)
}

// Exec is `docker exec` with MGPU_RUN_DIR set: like podman's, Docker's exec
// gives the process the container's configured environment, without the
// CDI spec's env edits.
func (e *Docker) Exec(ctx context.Context, id string, args ...string) (string, error) {
	return e.E.Docker(ctx, engineTimeout, append([]string{"exec", "-e", "MGPU_RUN_DIR=" + e.N.RunDir, id}, args...)...)
}

// InitPID is `docker inspect`'s State.Pid.
func (e *Docker) InitPID(ctx context.Context, id string) (int, error) {
	out, err := e.E.DockerStdout(ctx, 30*time.Second, "inspect", "--format", "{{.State.Pid}}", id)
	if err != nil {
		return 0, err
	}
	return statePid(out, id)
}

// Remove is `docker rm -f`.
func (e *Docker) Remove(ctx context.Context, id string) error {
	out, err := e.E.Docker(ctx, time.Minute, "rm", "-f", id)
	if err != nil && !strings.Contains(strings.ToLower(out), "no such container") {
		return fmt.Errorf("docker rm -f %s: %w: %s", id, err, out)
	}
	e.untrack(id)
	return nil
}

// Kill is `docker kill` (SIGKILL to the container's init).
func (e *Docker) Kill(ctx context.Context, id string) error {
	out, err := e.E.Docker(ctx, time.Minute, "kill", id)
	if err != nil {
		return fmt.Errorf("docker kill %s: %w: %s", id, err, out)
	}
	return nil
}

// Cleanup removes the containers Run and Start made.
func (e *Docker) Cleanup() error { return e.removeAll(e.Remove) }
