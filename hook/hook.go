package hook

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// Default time limits. The CDI spec gives each hook cdi.HookTimeout (10 s),
// after which the runtime kills it and fails the container; the hook stays
// well inside it, rollback included.
const (
	DefaultTimeout  = 5 * time.Second
	RollbackTimeout = 2 * time.Second
)

// Enforcer is the part of a device's control API the hook uses;
// *api.Client implements it.
type Enforcer interface {
	Device(ctx context.Context) (api.DeviceResponse, error)
	Create(ctx context.Context, req api.CreateRequest) (api.CreateResponse, error)
	List(ctx context.Context) ([]api.Instance, error)
	Destroy(ctx context.Context, name string) (api.DestroyResponse, error)
}

// Hook runs mgpu-hook's verbs against a node.
type Hook struct {
	cfg      *config.Config
	proc     Proc
	connect  func(index int) Enforcer
	log      io.Writer
	rollback time.Duration
	agent    Agent
}

// Option configures a Hook.
type Option func(*Hook)

// WithProc reads processes from p instead of the host's /proc.
func WithProc(p Proc) Option { return func(h *Hook) { h.proc = p } }

// WithEnforcers replaces the control-socket clients (tests).
func WithEnforcers(connect func(index int) Enforcer) Option {
	return func(h *Hook) { h.connect = connect }
}

// WithLog sets where destroy reports what it could not release.
func WithLog(w io.Writer) Option { return func(h *Hook) { h.log = w } }

// New returns a hook for the node described by cfg.
func New(cfg *config.Config, opts ...Option) *Hook {
	h := &Hook{cfg: cfg, proc: HostProc, log: io.Discard, rollback: RollbackTimeout}
	h.connect = func(index int) Enforcer {
		return api.NewClient(api.ControlSocket(cfg.DeviceRunDir(index)))
	}
	h.agent = agentapi.NewClient(agentapi.Socket(cfg.RunDir))
	for _, o := range opts {
		o(h)
	}
	return h
}

// Admitted is one instance Create made.
type Admitted struct {
	Device   int
	Instance api.Instance
}

// Create admits the container of st: it reads the bundle's config.json,
// finds the mgpu devices the CDI spec gave it (none: nothing to do),
// resolves the request, and asks each device's enforcer, in index order,
// for an instance with the same policy and quotas. On any failure the
// instances already made are destroyed and the error says why in one line.
func (h *Hook) Create(ctx context.Context, st *oci.State) ([]Admitted, error) {
	if st.Pid <= 0 {
		return nil, fmt.Errorf("the OCI state has no pid for container %q (mgpu-hook create runs as a createRuntime hook)", st.ID)
	}
	spec, err := LoadBundle(st.Bundle)
	if err != nil {
		return nil, err
	}
	devs, err := RequestedDevices(h.cfg, spec)
	if err != nil || len(devs) == 0 {
		return nil, err
	}
	id, err := h.proc.Identity(st.Pid)
	if err != nil {
		return nil, err
	}
	base := api.CreateRequest{Kind: api.KindContainer, ContainerID: st.ID, PID: st.Pid}
	var creqs []api.CreateRequest
	ann := Annotations(st, spec)
	pod, isPod, err := PodContainer(ann)
	switch {
	case err != nil:
		return nil, err
	case isPod:
		// A Kubernetes container: its quota is its own pod's.
		base.Pod = &api.PodRef{Namespace: pod.Namespace, Name: pod.Pod, Container: pod.Container}
		if creqs, err = h.podRequests(ctx, pod, devs, base); err != nil {
			return nil, err
		}
	default:
		var env []string
		if spec.Process != nil {
			env = spec.Process.Env
		}
		req, err := ResolveRequest(ann, env)
		if err != nil {
			return nil, err
		}
		base.Core, base.MemoryMiB = req.Core, req.MemoryMiB
		if req.PolicySet {
			base.Policy = req.Policy.String()
		}
		if req.ClassKey != "" {
			base.Class = req.Class.String()
		}
		for range devs {
			creqs = append(creqs, base)
		}
	}

	var done []Admitted
	for i, d := range devs {
		inst, uncertain, err := h.admit(ctx, d, id, creqs[i])
		if err != nil {
			if inst.Name != "" { // made, but not usable
				done = append(done, Admitted{Device: d.Index, Instance: inst})
			}
			h.undo(st.ID, id, done, uncertain, d.Index)
			return nil, err
		}
		done = append(done, Admitted{Device: d.Index, Instance: inst})
	}
	// For destroy: which init is this container's. Without the record
	// destroy only releases instances whose init has exited, so a failure
	// here keeps nothing from working that matters at poststop.
	_ = writeInitRecord(st.Bundle, id)
	return done, nil
}

// admit makes the instance on one device. On an error, a returned instance
// with a name was made and must be rolled back; uncertain reports a failure
// after which the enforcer may have made one anyway (a timeout or a lost
// connection), so rollback must look for it.
//
// The enforcer itself returns the existing instance of a container admitted
// before with the same process and quotas, refuses one with other quotas or
// whose init still runs, and replaces one whose init is gone.
func (h *Hook) admit(ctx context.Context, d Device, id Identity, creq api.CreateRequest) (api.Instance, bool, error) {
	e := h.connect(d.Index)
	if creq.MemoryMiB == 0 {
		// A whole GPU asked for without memory: all of it.
		info, err := e.Device(ctx)
		if err != nil {
			return api.Instance{}, false, deviceErr(d.Index, err)
		}
		creq.MemoryMiB = info.MemoryMiB
	}
	// The enforcer refuses the create if its GPU is not the CDI spec's.
	creq.UUID = d.UUID
	resp, err := e.Create(ctx, creq)
	if err != nil {
		// Uncertain unless the enforcer answered or was never reached.
		var ae *api.Error
		uncertain := !errors.As(err, &ae) && !errors.Is(err, api.ErrNotRunning)
		return api.Instance{}, uncertain, deviceErr(d.Index, err)
	}
	inst := resp.Instance
	if inst.PID != id.Pid || inst.StartTime != id.StartTime {
		// The enforcer read another process than the hook did: the
		// container's init exited and its pid was reused meanwhile.
		return inst, false, fmt.Errorf("device %d: container %q: init pid %d changed while it was admitted (%w)", d.Index, creq.ContainerID, id.Pid, ErrProcessGone)
	}
	return inst, false, nil
}

// undo destroys the instances Create made, and on the device whose outcome
// is uncertain the instance of this container if there is one. It has its
// own short deadline, so that a create that ran out of time still cleans up.
func (h *Hook) undo(containerID string, id Identity, done []Admitted, uncertain bool, uncertainDev int) {
	ctx, cancel := context.WithTimeout(context.Background(), h.rollback)
	defer cancel()
	for i := len(done) - 1; i >= 0; i-- {
		a := done[i]
		if _, err := h.connect(a.Device).Destroy(ctx, a.Instance.Name); err != nil {
			fmt.Fprintf(h.log, "mgpu: rollback: device %d: release %s: %v\n", a.Device, a.Instance.Name, err)
		}
	}
	if uncertain {
		ours := func(in api.Instance) bool { return in.PID == id.Pid && in.StartTime == id.StartTime }
		switch _, err := h.release(ctx, uncertainDev, containerID, ours); {
		case errors.Is(err, context.DeadlineExceeded):
			fmt.Fprintf(h.log, "mgpu: rollback: device %d: the enforcer did not answer in time either; an instance it made for this container is released when the container's init exits\n", uncertainDev)
		case err != nil:
			fmt.Fprintf(h.log, "mgpu: rollback: device %d: %v\n", uncertainDev, err)
		}
	}
}

// release destroys the instances of containerID on device index that ours
// says belong to this container, and returns the names released. Any other
// instance with this container id belongs to another live container with
// the same id (e.g. the same name in another containerd namespace) and is
// kept, with an error that says so.
func (h *Hook) release(ctx context.Context, index int, containerID string, ours func(api.Instance) bool) ([]string, error) {
	e := h.connect(index)
	insts, err := e.List(ctx)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, in := range insts {
		if in.ContainerID != containerID || in.Kind == api.KindProcessTree {
			continue
		}
		if !ours(in) {
			return names, fmt.Errorf("instance %s of container %q kept: its init (pid %d) still runs, so it belongs to another container with the same id", in.Name, containerID, in.PID)
		}
		if _, err := e.Destroy(ctx, in.Name); err != nil {
			return names, fmt.Errorf("release %s: %w", in.Name, err)
		}
		names = append(names, in.Name)
	}
	return names, nil
}

// Destroy releases every instance of the container st.ID names, on every
// device of the node that runs an enforcer and on every device its
// config.json asks for (so that a stopped enforcer is reported). It is
// idempotent: a container without instances is not an error. It returns the
// names released and one error per device it could not clean; the caller
// logs them and never fails the container's removal.
func (h *Hook) Destroy(ctx context.Context, st *oci.State) ([]string, []error) {
	devs := map[int]bool{}
	for _, i := range h.enforcedDevices() {
		devs[i] = false
	}
	if spec, err := LoadBundle(st.Bundle); err == nil {
		if req, err := RequestedDevices(h.cfg, spec); err == nil {
			for _, d := range req {
				devs[d.Index] = true
			}
		}
	}
	idx := make([]int, 0, len(devs))
	for i := range devs {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	// At poststop the container's processes are gone: its instances are
	// those whose init has exited, or whose init is the one create
	// recorded in this bundle (pid and start time) and the state names.
	// A live init matched by pid alone may be another container's with
	// the same id that reused the pid after this one's init exited.
	rec, hasRec := readInitRecord(st.Bundle)
	ours := func(in api.Instance) bool {
		if !h.proc.Alive(in.PID, in.StartTime) {
			return true
		}
		return hasRec && st.Pid > 0 && rec.Pid == st.Pid && in.PID == rec.Pid && in.StartTime == rec.StartTime
	}
	var released []string
	var errs []error
	for _, i := range idx {
		names, err := h.release(ctx, i, st.ID, ours)
		released = append(released, names...)
		if err != nil {
			if errors.Is(err, api.ErrNotRunning) && !devs[i] {
				continue // a socket left by a stopped enforcer of a device the container did not use
			}
			errs = append(errs, deviceErr(i, err))
		}
	}
	if hasRec && len(errs) == 0 {
		_ = os.Remove(filepath.Join(st.Bundle, initRecordName))
	}
	return released, errs
}

// enforcedDevices lists the devices with a control socket in the run
// directory.
func (h *Hook) enforcedDevices() []int {
	m, _ := filepath.Glob(filepath.Join(h.cfg.RunDir, "gpu*", api.ControlSocketName))
	var out []int
	for _, p := range m {
		s := strings.TrimPrefix(filepath.Base(filepath.Dir(p)), "gpu")
		if n, err := strconv.Atoi(s); err == nil && n >= 0 && strconv.Itoa(n) == s {
			if fi, err := os.Stat(p); err == nil && fi.Mode()&os.ModeSocket != 0 {
				out = append(out, n)
			}
		}
	}
	return out
}

// deviceErr names the device in err, unless the enforcer's message already
// does.
func deviceErr(index int, err error) error {
	var ae *api.Error
	if errors.As(err, &ae) && strings.HasPrefix(ae.Message, "device "+strconv.Itoa(index)+" ") {
		return err
	}
	if errors.Is(err, api.ErrNotRunning) {
		return fmt.Errorf("device %d: %w; start it (systemctl start mgpu-enforcer@%d)", index, err, index)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return &timeoutError{fmt.Sprintf("device %d: the enforcer did not answer in time (mgpu-hook --timeout); check mgpu-enforcer@%d", index, index)}
	}
	return fmt.Errorf("device %d: %w", index, err)
}

// timeoutError is an enforcer call that ran out of time; it is
// context.DeadlineExceeded.
type timeoutError struct{ msg string }

func (e *timeoutError) Error() string { return e.msg }
func (e *timeoutError) Unwrap() error { return context.DeadlineExceeded }
