package enforcer

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
	"github.com/mgpu-dev/mgpu/enforcer/procfs"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"github.com/mgpu-dev/mgpu/internal/policy"
)

// instance is one mgpuXinstY. Every field is guarded by Enforcer.mu.
type instance struct {
	id          int
	name        string
	kind        api.Kind
	containerID string
	pod         *api.PodRef // the Kubernetes pod container; nil: none
	pid         int         // init (container) or root (process tree)
	startTime   uint64      // of pid
	pidNS       uint64      // container's pid namespace; 0: the host's (match by cgroup)
	cgroup      string      // container's cgroup; "": none usable
	policy      policy.Policy
	class       policy.Class
	core        int
	memMiB      uint64
	created     time.Time

	reg  *region.Region
	path string

	rootFD   int  // pidfd of pid; -1 when none
	rootGone bool // pid has exited; released once no process is attached

	used   [region.MaxProcs / 64]uint64 // bitmap of slots in use
	nused  int
	slotFD [region.MaxProcs]int // pidfd per used slot; -1 when none

	// Counters of reaped processes (instance totals stay monotonic).
	reapedGPU, reapedThrottled, reapedLaunches uint64

	// What was accepted of each slot's counters (counters.go), and the
	// most GPU time one process may report queued.
	sane [region.MaxProcs]sane
	qcap uint64

	lastGPU      uint64
	lastLaunches uint64
	// What the last tick read of the slots: queued ns (before the tail
	// window) and whether a thread waited (missedWakeLocked).
	readQueued  uint64
	readWaiting bool

	// Queued work is believed only of an instance that could have
	// submitted it: the grant holder, or a recent one whose tail may still
	// run (tailWindow). held says it has held the grant; heldAt is the last
	// tick it held it at and heldQueued what it reported queued then.
	held       bool
	heldAt     time.Duration
	heldQueued uint64

	// The instance's wake socket pair (wake.go): the enforcer's receiving
	// end, in the loop's epoll set, and the end its processes get; -1
	// until a process first asks for it.
	wakeRecv, wakeSend int
}

// watchRef says what a watched pidfd stands for.
type watchRef struct {
	in   *instance
	slot int   // -1: the instance's root process
	seq  int32 // the watcher's registration number
}

func newInstance() *instance {
	in := &instance{rootFD: -1, wakeRecv: -1, wakeSend: -1}
	for i := range in.slotFD {
		in.slotFD[i] = -1
	}
	return in
}

func (in *instance) slotUsed(i int) bool { return in.used[i/64]&(1<<(i%64)) != 0 }

// setUsed marks slot i taken, here and in the region (after its Claim).
func (in *instance) setUsed(i int) {
	if !in.slotUsed(i) {
		in.used[i/64] |= 1 << (i % 64)
		in.nused++
		in.reg.SetUsed(in.used)
	}
}

// clearUsed marks slot i free, here and in the region (after its Clear).
func (in *instance) clearUsed(i int) {
	if in.slotUsed(i) {
		in.used[i/64] &^= 1 << (i % 64)
		in.nused--
		in.reg.SetUsed(in.used)
	}
}

// forSlots calls f for every used slot, in order.
func (in *instance) forSlots(f func(i int)) {
	for w, word := range in.used {
		for word != 0 {
			b := bits.TrailingZeros64(word)
			f(w*64 + b)
			word &= word - 1
		}
	}
}

// fold adds what was accepted of slot i's counters to the reaped totals
// and forgets the slot's history.
func (e *Enforcer) fold(in *instance, i int) {
	c := e.readSlot(in, i, in.sane[i].last)
	in.reapedGPU = sat(in.reapedGPU, c.gpu)
	in.reapedThrottled = sat(in.reapedThrottled, c.throttled)
	in.reapedLaunches = sat(in.reapedLaunches, c.launches)
	in.sane[i] = sane{}
}

// readSlot reads slot i's counters through its sanitizer (counters.go) at
// now, and logs the first out-of-range value of the slot's process.
func (e *Enforcer) readSlot(in *instance, i int, now time.Duration) counts {
	s := &in.sane[i]
	p := in.reg.Proc(i)
	c, why := s.read(p, now, in.qcap)
	if why != 0 && !s.bad {
		s.bad = true
		e.o.log.Warn("a process of the instance reports counters out of range; the enforcer ignores what is out of range",
			"instance", in.name, "container", in.containerID, "pid", p.PID.Load(), "slot", i, "why", why.String())
	}
	return c
}

func (in *instance) closeFDs() {
	if in.rootFD >= 0 {
		_ = unix.Close(in.rootFD)
		in.rootFD = -1
	}
	for i, fd := range in.slotFD {
		if fd >= 0 {
			_ = unix.Close(fd)
			in.slotFD[i] = -1
		}
	}
}

func noun(k api.Kind) string {
	if k == api.KindProcessTree {
		return "process tree"
	}
	return "container"
}

func (in *instance) record() stateInstance {
	return stateInstance{
		Name: in.name, ID: in.id, Kind: in.kind, ContainerID: in.containerID, Pod: in.pod,
		PID: in.pid, StartTime: in.startTime, PidNS: in.pidNS, Cgroup: in.cgroup,
		Policy: in.policy, Class: in.class, Core: in.core, MemoryMiB: in.memMiB, Created: in.created,
		ReapedGPUNs: in.reapedGPU, ReapedThrottledNs: in.reapedThrottled, ReapedLaunches: in.reapedLaunches,
	}
}

func (in *instance) api(dev int) api.Instance {
	return api.Instance{
		Name: in.name, Device: dev, ID: in.id, Kind: in.kind, ContainerID: in.containerID,
		PID: in.pid, StartTime: in.startTime, PidNS: in.pidNS, Cgroup: in.cgroup,
		Policy: in.policy.String(), Class: in.class.String(), Core: in.core, MemoryMiB: in.memMiB, Created: in.created,
		Processes: in.nused, Region: in.path, Pod: in.pod,
	}
}

// Request errors; the HTTP layer maps them to 400, 404 and 409.
var (
	ErrInvalid  = errors.New("invalid request")
	ErrNotFound = errors.New("no such instance")
	ErrRefused  = errors.New("refused")
)

// reqError is an error whose text is the one line the user sees.
type reqError struct {
	kind error
	msg  string
}

func (e *reqError) Error() string        { return e.msg }
func (e *reqError) Is(target error) bool { return target == e.kind }

func refusef(format string, a ...any) error {
	return &reqError{kind: ErrRefused, msg: fmt.Sprintf(format, a...)}
}

func invalidf(format string, a ...any) error {
	return &reqError{kind: ErrInvalid, msg: fmt.Sprintf(format, a...)}
}

// identity is what the enforcer learned about a new instance's process.
type identity struct {
	startTime uint64
	pidNS     uint64
	cgroup    string
}

// Create admits a new instance (or returns the container's existing one).
// Admission is atomic: checks and insertion happen under one lock.
func (e *Enforcer) Create(req api.CreateRequest) (api.CreateResponse, error) {
	if err := req.Validate(); err != nil {
		return api.CreateResponse{}, &reqError{kind: ErrInvalid, msg: err.Error()}
	}
	e.mu.Lock()
	err := e.checkQuotasLocked(req)
	e.mu.Unlock()
	if err != nil {
		return api.CreateResponse{}, err
	}
	id, err := e.identify(req)
	if err != nil {
		return api.CreateResponse{}, err
	}
	pfd, err := e.pidfd(req.PID, id.startTime)
	if err != nil {
		return api.CreateResponse{}, invalidf("pid %d has exited", req.PID)
	}
	e.mu.Lock()
	in, existing, err := e.admitLocked(req, id, pfd)
	var out api.CreateResponse
	if err == nil {
		out = api.CreateResponse{Instance: in.api(e.index), Existing: existing}
	}
	e.mu.Unlock()
	if err != nil || existing {
		_ = unix.Close(pfd)
		return out, err
	}
	if err := e.save(); err != nil {
		e.mu.Lock()
		e.releaseLocked(in, "its state could not be written")
		e.mu.Unlock()
		return api.CreateResponse{}, fmt.Errorf("write state %s: %w", e.statePth, err)
	}
	e.o.log.Info("created", "instance", in.name, "kind", in.kind, "container", in.containerID, "pid", in.pid,
		"core", in.core, "memory_mib", in.memMiB)
	e.kickLoop()
	e.mu.Lock()
	e.refillBlankLocked()
	e.mu.Unlock()
	return out, nil
}

func (e *Enforcer) identify(req api.CreateRequest) (identity, error) {
	st, err := e.o.proc.Stat(req.PID)
	if err != nil || st.State == 'Z' || st.State == 'X' {
		return identity{}, invalidf("pid %d does not exist or has exited", req.PID)
	}
	id := identity{startTime: st.StartTime}
	if req.Kind == api.KindProcessTree {
		if req.PID == 1 {
			return identity{}, invalidf("pid 1 cannot be the root of a process-tree instance")
		}
		return id, nil
	}
	ns, err := e.o.proc.PidNS(req.PID)
	if err != nil {
		return identity{}, invalidf("pid %d: cannot read its pid namespace: %v", req.PID, err)
	}
	if ns != e.selfNS {
		id.pidNS = ns
	}
	cg := req.Cgroup
	if cg != "" && e.coversSelf(cg) {
		return identity{}, invalidf("cgroup %s contains the enforcer itself; name the container's own cgroup", cg)
	}
	if cg == "" {
		// The deepest of its cgroups (one per hierarchy on cgroup v1)
		// that does not contain the enforcer.
		cgs, _ := e.o.proc.Cgroups(req.PID)
		for _, c := range cgs {
			if !e.coversSelf(c) && len(c) > len(cg) {
				cg = c
			}
		}
	}
	id.cgroup = cg
	if id.pidNS == 0 && id.cgroup == "" {
		return identity{}, refusef("container %s (pid %d) shares the enforcer's pid namespace and cgroup, so its processes cannot be told from the host's; run it in its own pid namespace or cgroup",
			req.ContainerID, req.PID)
	}
	return id, nil
}

// coversSelf reports whether cgroup cg is the root or contains one of the
// enforcer's own cgroups (matching by it would match host processes).
func (e *Enforcer) coversSelf(cg string) bool {
	if cg == "/" {
		return true
	}
	for _, own := range e.selfCgs {
		if own == cg || procfs.Under(own, cg) {
			return true
		}
	}
	return false
}

// pidfd opens a pidfd for pid and checks that it is the process that
// started at startTime.
func (e *Enforcer) pidfd(pid int, startTime uint64) (int, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	if !e.alive(pid, startTime) {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("pid %d: %w", pid, os.ErrProcessDone)
	}
	return fd, nil
}

// alive reports whether pid is the live process that started at startTime.
func (e *Enforcer) alive(pid int, startTime uint64) bool {
	st, err := e.o.proc.Stat(pid)
	return err == nil && st.StartTime == startTime && st.State != 'Z' && st.State != 'X'
}

func (e *Enforcer) admitLocked(req api.CreateRequest, id identity, pfd int) (*instance, bool, error) {
	if e.closed {
		return nil, false, errors.New("the enforcer is shutting down")
	}
	who := noun(req.Kind)
	if req.ContainerID != "" {
		if old := e.byCID[req.ContainerID]; old != nil {
			sameProc := old.pid == req.PID && old.startTime == id.startTime
			switch {
			case sameProc && old.core == req.Core && old.memMiB == req.MemoryMiB && (req.Policy == "" || req.Policy == old.policy.String()) && classOf(req) == old.class:
				return old, true, nil
			case sameProc:
				return nil, false, refusef("container %s already has instance %s with core %d, memory %d MiB", req.ContainerID, old.name, old.core, old.memMiB)
			case !old.rootGone && e.alive(old.pid, old.startTime):
				return nil, false, refusef("container %s already has instance %s for pid %d", req.ContainerID, old.name, old.pid)
			default:
				e.releaseLocked(old, "its container id was reused by a new process")
			}
		}
	}
	if id.pidNS != 0 {
		// Processes are matched to a container by pid namespace first: two
		// instances in one namespace would be one, and the backstop would
		// count both containers' memory against one quota.
		for _, o := range e.list {
			if o.kind == api.KindContainer && o.pidNS == id.pidNS {
				return nil, false, refusef("container %s shares its pid namespace with container %s (instance %s), so their processes cannot be told apart; give the GPU to one container of the pod, or do not share the pid namespace (shareProcessNamespace, --pid container:)",
					req.ContainerID, o.containerID, o.name)
			}
		}
	}
	pol := e.settings.ComputePolicy
	if err := e.checkQuotasLocked(req); err != nil {
		return nil, false, err
	}
	if len(e.list) >= e.settings.MaxInstances {
		return nil, false, refusef("device %d already has %d instances, the most it admits (max_instances = %d)", e.index, len(e.list), e.settings.MaxInstances)
	}
	class := classOf(req)
	cores, _, mem := e.sumsLocked()
	if pol.Admission() && class == policy.Online && cores+req.Core > 100 {
		return nil, false, refusef("device %d has %d%% compute free under %s (%d%% allocated), %s asks %d%%", e.index, 100-cores, pol, cores, who, req.Core)
	}
	total := e.dev.MemoryMiB()
	if mem+req.MemoryMiB > total {
		var free uint64
		if mem < total {
			free = total - mem
		}
		return nil, false, refusef("device %d has %d MiB memory free (%d of %d MiB allocated), %s asks %d MiB", e.index, free, mem, total, who, req.MemoryMiB)
	}
	y := 0
	for e.byID[y] != nil {
		y++
	}
	in := newInstance()
	in.id, in.name, in.kind, in.containerID, in.pod = y, api.InstanceName(e.index, y), req.Kind, req.ContainerID, req.Pod
	in.pid, in.startTime, in.pidNS, in.cgroup = req.PID, id.startTime, id.pidNS, id.cgroup
	in.policy, in.class, in.core, in.memMiB, in.created = pol, class, req.Core, req.MemoryMiB, time.Now().UTC()
	in.qcap = queueCap(uint64(in.maxQueued()), uint64(e.settings.Period())) //nolint:gosec // positive
	in.path = filepath.Join(e.regions, in.name)
	if err := region.Remove(in.path); err != nil {
		return nil, false, fmt.Errorf("remove stale region: %w", err)
	}
	reg, err := e.newRegionLocked(in.path, e.params(in))
	if err != nil {
		return nil, false, err
	}
	reg.L().EnforcerEpoch.Store(e.epoch)
	in.reg = reg
	e.insertLocked(in)
	in.rootFD = e.watchLocked(pfd, watchRef{in: in, slot: -1})
	return in, false, nil
}

// checkQuotasLocked checks what needs no identity: the device's UUID, core,
// memory, policy.
func (e *Enforcer) checkQuotasLocked(req api.CreateRequest) error {
	who := noun(req.Kind)
	if req.UUID != "" && e.dev.UUID != "" && req.UUID != e.dev.UUID {
		return refusef("device %d is %s, not %s; regenerate the CDI spec (mgpu-cli cdi generate)", e.index, e.dev.UUID, req.UUID)
	}
	if req.Core < 1 || req.Core > 100 {
		return refusef("core %d is outside 1..100 (percent of device %d's time)", req.Core, e.index)
	}
	if req.MemoryMiB == 0 {
		return refusef("memory must be at least 1 MiB, %s asks 0", who)
	}
	if req.Policy != "" {
		want, err := policy.Parse(req.Policy)
		if err != nil {
			return invalidf("%v", err)
		}
		if pol := e.settings.ComputePolicy; want != pol {
			return refusef("device %d runs %s, %s asks %s", e.index, pol, who, want)
		}
	}
	if req.Class != "" {
		c, err := policy.ParseClass(req.Class)
		if err != nil {
			return invalidf("%v", err)
		}
		if c == policy.Offline && e.settings.OnlineOfflineSwitch == 0 {
			return refusef("device %d does not admit offline instances (online_offline_switch = 0); set online_offline_switch = 1 (or 2) for it in the node config, which applies once the device is empty", e.index)
		}
	}
	return nil
}

// classOf is a checked request's class (checkQuotasLocked).
func classOf(req api.CreateRequest) policy.Class {
	if req.Class == "" {
		return policy.Online
	}
	c, _ := policy.ParseClass(req.Class)
	return c
}

// sumsLocked sums the online and the offline instances' cores, and every
// instance's memory.
func (e *Enforcer) sumsLocked() (online, offline int, memMiB uint64) {
	for _, in := range e.list {
		if in.class == policy.Offline {
			offline += in.core
		} else {
			online += in.core
		}
		memMiB += in.memMiB
	}
	return online, offline, memMiB
}

func (e *Enforcer) params(in *instance) region.Params {
	return region.Params{
		DeviceIndex: uint32(e.index), InstanceID: uint32(in.id), //nolint:gosec // small
		Policy: uint32(in.policy), Core: uint32(in.core), //nolint:gosec // 1..100
		MemoryLimit: in.memMiB << 20,
		PeriodNs:    uint64(e.settings.Period()), //nolint:gosec // positive
		MaxQueuedNs: uint64(in.maxQueued()),      //nolint:gosec // positive
	}
}

// maxQueued is the instance's queue bound: an offline instance's is
// smaller, so that the work it has queued when an online instance wakes
// ends sooner (docs/arbiter.md "Online and offline instances").
func (in *instance) maxQueued() time.Duration {
	if in.class == policy.Offline {
		return arbiter.DefaultOfflineMaxQueued
	}
	return arbiter.DefaultMaxQueued
}

func (e *Enforcer) insertLocked(in *instance) {
	e.gen++
	e.byID[in.id] = in
	if in.containerID != "" {
		e.byCID[in.containerID] = in
	}
	i := 0
	for i < len(e.list) && e.list[i].id < in.id {
		i++
	}
	e.list = append(e.list, nil)
	copy(e.list[i+1:], e.list[i:])
	e.list[i] = in
	e.arb.AddClass(in.id, in.core, in.class)
}

// releaseLocked removes an instance: its grant is withdrawn, its region
// file removed (processes that still map it keep a dead copy), and its
// watches closed. The caller writes the state afterwards.
func (e *Enforcer) releaseLocked(in *instance, why string) {
	if e.byID[in.id] != in {
		return
	}
	e.releasedGPU = sat(e.releasedGPU, in.gpuTotal())
	delete(e.byID, in.id)
	e.gen++
	if in.containerID != "" && e.byCID[in.containerID] == in {
		delete(e.byCID, in.containerID)
	}
	for i, x := range e.list {
		if x == in {
			e.list = append(e.list[:i], e.list[i+1:]...)
			break
		}
	}
	e.arb.Remove(in.id)
	delete(e.usage, in.id)
	if in.rootFD >= 0 {
		e.unwatchLocked(in.rootFD)
		in.rootFD = -1
	}
	for i, fd := range in.slotFD {
		if fd >= 0 {
			e.unwatchLocked(fd)
			in.slotFD[i] = -1
		}
	}
	e.closeWakeLocked(in)
	e.guard(func() { in.reg.SetGrant(0) })
	_ = in.reg.Close()
	if err := region.Remove(in.path); err != nil {
		e.o.log.Warn("remove region", "path", in.path, "err", err)
	}
	e.o.log.Info("released", "instance", in.name, "container", in.containerID, "reason", why)
	if len(e.list) == 0 {
		e.applyPendingLocked()
	}
}

// applyPendingLocked switches an empty device to the configured settings.
func (e *Enforcer) applyPendingLocked() {
	if e.settings == e.configured {
		return
	}
	e.o.log.Info("device is empty; applying the configured settings", "device", e.index,
		"policy", e.configured.ComputePolicy.String(), "compute_timeslice", e.configured.ComputeTimeslice,
		"compute_timeslice_native_burst", e.configured.ComputeTimesliceNativeBurst, "online_offline_switch", e.configured.OnlineOfflineSwitch)
	e.settings = e.configured
	e.arb = e.newArbiter()
}

func (e *Enforcer) newArbiter() *arbiter.Arbiter {
	s := e.settings
	c := arbiter.Config{Policy: s.ComputePolicy, Period: s.Period(), FillOneAtATime: s.OnlineOfflineSwitch == 2}
	if s.ComputePolicy == policy.NativeBurstShare {
		c.Quantum = s.NativeSlice()
	}
	return arbiter.New(c)
}

// Destroy releases the instance with the given name. It is idempotent:
// releasing an unknown instance reports Released false.
func (e *Enforcer) Destroy(name string) (api.DestroyResponse, error) {
	dev, id, err := api.ParseInstanceName(name)
	if err != nil {
		return api.DestroyResponse{}, invalidf("%v", err)
	}
	if dev != e.index {
		return api.DestroyResponse{}, invalidf("instance %s belongs to device %d, this is device %d's enforcer", name, dev, e.index)
	}
	e.mu.Lock()
	in := e.byID[id]
	if in != nil {
		e.releaseLocked(in, "destroyed")
	}
	e.mu.Unlock()
	if in == nil {
		return api.DestroyResponse{Name: name}, nil
	}
	return api.DestroyResponse{Released: true, Name: name}, e.save()
}

// DestroyContainer releases the instance of a container id (idempotent).
func (e *Enforcer) DestroyContainer(cid string) (api.DestroyResponse, error) {
	if cid == "" {
		return api.DestroyResponse{}, invalidf("container_id is empty")
	}
	e.mu.Lock()
	in := e.byCID[cid]
	if in != nil {
		e.releaseLocked(in, "destroyed")
	}
	e.mu.Unlock()
	if in == nil {
		return api.DestroyResponse{}, nil
	}
	return api.DestroyResponse{Released: true, Name: in.name}, e.save()
}

// List returns the instances by id.
func (e *Enforcer) List() []api.Instance {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]api.Instance, 0, len(e.list))
	for _, in := range e.list {
		out = append(out, in.api(e.index))
	}
	return out
}

// Get returns one instance.
func (e *Enforcer) Get(name string) (api.Instance, error) {
	dev, id, err := api.ParseInstanceName(name)
	if err != nil {
		return api.Instance{}, invalidf("%v", err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	in := e.byID[id]
	if dev != e.index || in == nil {
		return api.Instance{}, &reqError{kind: ErrNotFound, msg: fmt.Sprintf("no instance %s on device %d", name, e.index)}
	}
	return in.api(e.index), nil
}

// gpuTotal is the instance's measured GPU time: its reaped processes' and
// its attached ones' (as sanity-checked).
func (in *instance) gpuTotal() uint64 {
	acc := in.reapedGPU
	in.forSlots(func(i int) { acc = sat(acc, in.sane[i].total()) })
	return acc
}

// Device returns the device's live allocation.
func (e *Enforcer) Device() api.DeviceResponse {
	e.mu.Lock()
	defer e.mu.Unlock()
	cores, offline, mem := e.sumsLocked()
	busy := e.releasedGPU
	for _, in := range e.list {
		busy = sat(busy, in.gpuTotal())
	}
	total := e.dev.MemoryMiB()
	var free uint64
	if mem < total {
		free = total - mem
	}
	s := e.settings
	return api.DeviceResponse{
		Index: e.index, UUID: e.dev.UUID, Name: e.dev.Name, MemoryMiB: total,
		Policy: s.ComputePolicy.String(), PolicyCode: s.ComputePolicy.Code(),
		ConfiguredPolicy: e.configured.ComputePolicy.String(),
		TimesliceMS:      s.ComputeTimeslice, NativeSliceUS: s.ComputeTimesliceNativeBurst,
		MaxInstances: s.MaxInstances, OnlineOfflineSwitch: s.OnlineOfflineSwitch,
		Instances: len(e.list), CoreSum: cores, CoreFree: max(0, 100-cores), OfflineCoreSum: offline,
		MemoryAllocatedMiB: mem, MemoryFreeMiB: free,
		EnforcerPID: os.Getpid(), EnforcerEpoch: e.epoch, Started: e.started.UTC(),
		BusyNs: busy,
	}
}

// Stats returns every instance's accounting.
func (e *Enforcer) Stats() []api.InstanceStats {
	var violations map[string]uint64
	if e.backstop != nil {
		violations = map[string]uint64{}
		for _, c := range e.backstop.Counts() {
			violations[c.Instance] = sat(violations[c.Instance], c.Episodes)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []api.InstanceStats
	for e.guard(func() { out = e.statsLocked() }) {
		// a truncated region was repaired and its instance released: again
	}
	for i := range out {
		out[i].Violations = violations[out[i].Name]
	}
	return out
}

func (e *Enforcer) statsLocked() []api.InstanceStats {
	out := make([]api.InstanceStats, 0, len(e.list))
	for _, in := range e.list {
		as := e.arb.Stats(in.id)
		s := api.InstanceStats{
			Name: in.name, Core: in.core,
			GrantedNs: int64(as.Granted), DemandThrottledNs: int64(as.Throttled), Holding: as.Holding,
			GPUNs: in.reapedGPU, ThrottledNs: in.reapedThrottled, Launches: in.reapedLaunches,
			MemoryLimitBytes: in.memMiB << 20,
			Processes:        []api.Process{},
		}
		in.forSlots(func(i int) {
			p := in.reg.Proc(i)
			c := e.readSlot(in, i, in.sane[i].last)
			pr := api.Process{
				PID: int(p.PID.Load()), Slot: i, GPUNs: c.gpu, MemReservedBytes: c.mem,
				Launches: c.launches, ThrottledNs: c.throttled, Waiting: min(p.Waiting.Load(), maxWaiting),
			}
			s.GPUNs = sat(s.GPUNs, pr.GPUNs)
			s.ThrottledNs = sat(s.ThrottledNs, pr.ThrottledNs)
			s.Launches = sat(s.Launches, pr.Launches)
			s.MemoryUsedBytes = sat(s.MemoryUsedBytes, pr.MemReservedBytes)
			s.QueuedNs = sat(s.QueuedNs, c.queued)
			s.Processes = append(s.Processes, pr)
		})
		out = append(out, s)
	}
	return out
}
