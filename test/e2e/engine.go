package e2e

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Container is one container to run on the node.
type Container struct {
	ID      string
	Kind    string   // CDI kind of the node's spec (Node.GenerateSpec)
	Devices []string // CDI device names of Kind: "0", "all", "GPU-…"
	// The request; an empty value leaves the key out. ctr passes them as
	// annotations (vke.volcengine.com/mgpu-*), podman as environment
	// variables (MGPU_*).
	Policy, Core, Memory string
	Env                  []string // more environment
	Args                 []string // the command
	// JoinPID, when not 0, is a host pid whose pid namespace the container
	// joins instead of getting its own (podman --pid ns:PATH, ctr
	// --with-ns pid:PATH; Kubernetes' shareProcessNamespace does the same).
	JoinPID int
}

// pidNS is the path of the pid namespace c joins, or "".
func (c Container) pidNS() string {
	if c.JoinPID == 0 {
		return ""
	}
	return fmt.Sprintf("/proc/%d/ns/pid", c.JoinPID)
}

// Engine runs containers on a Node: ctr against a private containerd, or
// podman. Every container gets the node's simulated-driver state directory
// (same path) and the node's IODir at /e2e, both read-write.
type Engine interface {
	Name() string
	// Run runs c in the foreground, removes it when it ends, and returns
	// what the engine and the container printed.
	Run(ctx context.Context, c Container) (string, error)
	// Start creates and starts c detached.
	Start(ctx context.Context, c Container) (string, error)
	// Exec runs args in the running container id and waits for it.
	Exec(ctx context.Context, id string, args ...string) (string, error)
	// InitPID is the host pid of the container's first process.
	InitPID(ctx context.Context, id string) (int, error)
	// Remove kills (SIGKILL) and removes the container.
	Remove(ctx context.Context, id string) error
	// Cleanup removes every container the engine made.
	Cleanup() error
}

// request is the container's request keys (compute-policy, core, memory)
// that have a value.
func (c Container) request() map[string]string {
	r := map[string]string{}
	for k, v := range map[string]string{"compute-policy": c.Policy, "core": c.Core, "memory": c.Memory} {
		if v != "" {
			r[k] = v
		}
	}
	return r
}

// envKey is the environment variable of a request key.
var envKey = map[string]string{"core": "MGPU_CORE", "memory": "MGPU_MEMORY", "compute-policy": "MGPU_COMPUTE_POLICY"}

// Mounts and environment every container gets.
func (n *Node) containerEnv(c Container) []string {
	return append(n.FakeEnv(), c.Env...)
}

const engineTimeout = 2 * time.Minute

// tracked is the set of containers an engine made and has not removed yet.
type tracked struct {
	mu  sync.Mutex
	ids map[string]bool
}

func (t *tracked) track(id string) {
	t.mu.Lock()
	if t.ids == nil {
		t.ids = map[string]bool{}
	}
	t.ids[id] = true
	t.mu.Unlock()
}

func (t *tracked) untrack(id string) {
	t.mu.Lock()
	delete(t.ids, id)
	t.mu.Unlock()
}

// removeAll removes every tracked container with remove.
func (t *tracked) removeAll(remove func(context.Context, string) error) error {
	t.mu.Lock()
	var ids []string
	for id := range t.ids {
		ids = append(ids, id)
	}
	t.mu.Unlock()
	var errs []error
	for _, id := range ids {
		errs = append(errs, remove(context.Background(), id))
	}
	return errors.Join(errs...)
}

// Ctr runs containers with ctr.
type Ctr struct {
	N  *Node
	CD *Containerd
	tracked
}

// NewCtr returns the ctr engine of node n on containerd cd.
func NewCtr(n *Node, cd *Containerd) *Ctr { return &Ctr{N: n, CD: cd} }

// Name is "ctr".
func (e *Ctr) Name() string { return "ctr" }

func (e *Ctr) runArgs(c Container, mode string) []string {
	args := []string{"run", mode, "--rootfs"}
	for _, d := range c.Devices {
		args = append(args, "--device", c.Kind+"="+d)
	}
	for k, v := range c.request() {
		args = append(args, "--annotation", "vke.volcengine.com/mgpu-"+k+"="+v)
	}
	for _, kv := range e.N.containerEnv(c) {
		args = append(args, "--env", kv)
	}
	if ns := c.pidNS(); ns != "" {
		args = append(args, "--with-ns", "pid:"+ns)
	}
	args = append(args,
		"--mount", "type=bind,src="+e.N.FakeState+",dst="+e.N.FakeState+",options=rbind:rw",
		"--mount", "type=bind,src="+e.N.IODir+",dst=/e2e,options=rbind:rw",
		e.N.Rootfs, c.ID)
	return append(args, c.Args...)
}

// Run is `ctr run --rm`.
func (e *Ctr) Run(ctx context.Context, c Container) (string, error) {
	e.track(c.ID)
	return e.CD.Ctr(ctx, engineTimeout, e.runArgs(c, "--rm")...)
}

// Start is `ctr run -d`.
func (e *Ctr) Start(ctx context.Context, c Container) (string, error) {
	e.track(c.ID)
	return e.CD.Ctr(ctx, engineTimeout, e.runArgs(c, "-d")...)
}

var execSeq struct {
	sync.Mutex
	n int
}

// Exec is `ctr task exec`.
func (e *Ctr) Exec(ctx context.Context, id string, args ...string) (string, error) {
	execSeq.Lock()
	execSeq.n++
	eid := fmt.Sprintf("exec%d", execSeq.n)
	execSeq.Unlock()
	return e.CD.Ctr(ctx, engineTimeout, append([]string{"task", "exec", "--exec-id", eid, id}, args...)...)
}

// InitPID reads `ctr task ls`.
func (e *Ctr) InitPID(ctx context.Context, id string) (int, error) {
	out, err := e.CD.CtrStdout(ctx, 30*time.Second, "task", "ls")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[0] == id {
			if f[2] != "RUNNING" {
				return 0, fmt.Errorf("task %s is %s", id, f[2])
			}
			return strconv.Atoi(f[1])
		}
	}
	return 0, fmt.Errorf("no task %s in:\n%s", id, out)
}

// Remove is `ctr task rm -f` and `ctr containers rm`.
func (e *Ctr) Remove(ctx context.Context, id string) error {
	_, _ = e.CD.Ctr(ctx, 30*time.Second, "task", "rm", "-f", id)
	out, err := e.CD.Ctr(ctx, 30*time.Second, "containers", "rm", id)
	if err != nil && !strings.Contains(out, "not found") {
		return fmt.Errorf("ctr containers rm %s: %w: %s", id, err, out)
	}
	e.untrack(id)
	return nil
}

// Cleanup removes the containers Run and Start made.
func (e *Ctr) Cleanup() error { return e.removeAll(e.Remove) }

// Podman runs containers with podman (rootful).
type Podman struct {
	N    *Node
	Path string // the podman binary
	tracked
}

// NewPodman returns the podman engine of node n (podman from PATH).
func NewPodman(n *Node) (*Podman, error) {
	p, err := exec.LookPath("podman")
	if err != nil {
		return nil, err
	}
	return &Podman{N: n, Path: p}, nil
}

// Name is "podman".
func (e *Podman) Name() string { return "podman" }

func (e *Podman) runArgs(c Container, mode string) []string {
	args := []string{"run", mode, "--name", c.ID, "--network", "none",
		"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"}
	for _, d := range c.Devices {
		args = append(args, "--device", c.Kind+"="+d)
	}
	for k, v := range c.request() {
		args = append(args, "-e", envKey[k]+"="+v)
	}
	for _, kv := range e.N.containerEnv(c) {
		args = append(args, "-e", kv)
	}
	if ns := c.pidNS(); ns != "" {
		args = append(args, "--pid", "ns:"+ns)
	}
	args = append(args, "-v", e.N.FakeState+":"+e.N.FakeState+":rw", "-v", e.N.IODir+":/e2e:rw",
		"--rootfs", e.N.Rootfs)
	return append(args, c.Args...)
}

// Run is `podman run --rm`.
func (e *Podman) Run(ctx context.Context, c Container) (string, error) {
	e.track(c.ID)
	return run(ctx, engineTimeout, nil, e.Path, e.runArgs(c, "--rm")...)
}

// Start is `podman run -d`.
func (e *Podman) Start(ctx context.Context, c Container) (string, error) {
	e.track(c.ID)
	return run(ctx, engineTimeout, nil, e.Path, e.runArgs(c, "-d")...)
}

// Exec is `podman exec`, with MGPU_RUN_DIR set: podman 4.3 gives exec'd
// processes the container's configured environment, without the CDI
// spec's env edits (MGPU_RUN_DIR, MGPU_DEVICE_X), so on a node whose
// run_dir is not the shim's default (/run/mgpu) they would not find the
// client socket (TestExecJoinsInstance shows it). ExecRaw leaves it out.
func (e *Podman) Exec(ctx context.Context, id string, args ...string) (string, error) {
	return e.ExecRaw(ctx, append([]string{"--env", "MGPU_RUN_DIR=" + e.N.RunDir, id}, args...)...)
}

// ExecRaw is `podman exec ARGS...` as given.
func (e *Podman) ExecRaw(ctx context.Context, args ...string) (string, error) {
	return run(ctx, engineTimeout, nil, e.Path, append([]string{"exec"}, args...)...)
}

// InitPID is `podman inspect`'s State.Pid.
func (e *Podman) InitPID(ctx context.Context, id string) (int, error) {
	out, err := runStdout(ctx, 30*time.Second, e.Path, "inspect", "--format", "{{.State.Pid}}", id)
	if err != nil {
		return 0, err
	}
	return statePid(out, id)
}

// statePid reads the output of `podman|docker inspect --format
// {{.State.Pid}}`: 0 is a container that does not run.
func statePid(out, id string) (int, error) {
	pid, err := strconv.Atoi(strings.TrimSpace(out))
	if err == nil && pid <= 0 {
		err = fmt.Errorf("container %s does not run", id)
	}
	return pid, err
}

// Remove is `podman rm -f`.
func (e *Podman) Remove(ctx context.Context, id string) error {
	out, err := run(ctx, time.Minute, nil, e.Path, "rm", "-f", "-t", "0", id)
	if err != nil && !strings.Contains(out, "no such container") {
		return fmt.Errorf("podman rm %s: %w: %s", id, err, out)
	}
	e.untrack(id)
	return nil
}

// Cleanup removes the containers Run and Start made.
func (e *Podman) Cleanup() error { return e.removeAll(e.Remove) }
