// Package backstop checks what the driver itself reports about a device
// against what the enforcer granted: an instance whose processes hold more
// device memory than its quota, an instance whose processes were busy on
// the device longer than the enforcer accounted for it over a window, and a
// process on the device that belongs to no instance. It is what makes the
// quotas hold against code that skips the shim or lies in its counters
// (DESIGN.md "Tenants are untrusted"); docs/backstop.md describes it.
//
// The driver's view comes through a Source (NVMLSource in production), host
// processes are identified by their start time (Procs) and killed through a
// Killer that is safe against pid reuse (PidfdKiller). The enforcer calls
// Watcher.Check every interval with a monotonic time, so the logic runs on a
// virtual clock in tests.
package backstop

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

// Kind is the kind of a violation.
type Kind string

// The kinds of violation.
const (
	// KindMemory: the instance's processes hold more device memory than
	// its limit (Watcher's rule: quota + allowance × min(processes, cap)).
	KindMemory Kind = "memory"
	// KindCompute: over the window, the instance's processes were busy on
	// the device longer than the enforcer accounted for it, by more than
	// the tolerance.
	KindCompute Kind = "compute"
	// KindUnattributed: a process uses the device and belongs to no
	// instance.
	KindUnattributed Kind = "unattributed"
)

// Kinds lists the kinds of violation.
var Kinds = []Kind{KindMemory, KindCompute, KindUnattributed}

// Action is what is done about a violation.
type Action string

// The actions.
const (
	// ActionLog logs the violation (once per episode) and counts it.
	ActionLog Action = "log"
	// ActionKill also kills the offending processes with SIGKILL.
	ActionKill Action = "kill"
)

// ParseAction parses "log" or "kill".
func ParseAction(s string) (Action, error) {
	switch a := Action(s); a {
	case ActionLog, ActionKill:
		return a, nil
	}
	return "", fmt.Errorf("unknown action %q (want %q or %q)", s, ActionLog, ActionKill)
}

// Defaults of the options.
const (
	DefaultWindow           = time.Second
	DefaultTolerancePercent = 10
	DefaultMemoryAllowance  = 0
	// DefaultAllowanceProcesses is the most processes of one instance
	// the memory allowance counts for: an instance's slack over its quota
	// is at most this many allowances, however many processes it runs.
	DefaultAllowanceProcesses = 4
	DefaultMemoryAction       = ActionKill
	DefaultComputeAction      = ActionLog
	DefaultUnattributedAction = ActionLog
	// minRetain is the least time the attribution of a process is kept
	// after it was last seen alive, so that utilization samples the driver
	// reports after the process exited still count for its instance.
	minRetain = 2 * time.Second
)

// Instance is what the enforcer knows of one instance of the device.
type Instance struct {
	// Name is the instance's name (what the attribute function returns).
	Name string
	// MemoryQuota is the instance's device-memory quota in bytes.
	MemoryQuota uint64
	// Accounted is the cumulative GPU time the enforcer accounted for the
	// instance (from its processes' reports). It should not decrease; a
	// decrease counts as no growth, and growth is taken to be at most the
	// time elapsed (one instance cannot be busier than the device).
	Accounted time.Duration
}

// Evidence is the numbers a violation was judged on.
type Evidence struct {
	// Memory (KindMemory; UsedMemory also for KindUnattributed).
	UsedMemory  uint64 // bytes the driver charges to the processes
	MemoryQuota uint64 // the instance's quota, bytes
	MemoryLimit uint64 // MemoryQuota + Allowance × min(Processes, AllowanceCap), bytes
	Allowance   uint64 // the allowance per process, bytes
	// AllowanceCap is the most processes the allowance counts for.
	AllowanceCap int
	// Processes is how many of the instance's processes the driver
	// charges memory to.
	Processes int

	// Compute (KindCompute; DriverTime also for KindUnattributed, over
	// the last interval).
	Window        time.Duration // the span judged, at least the window
	DriverTime    time.Duration // busy time the driver reports over Window
	AccountedTime time.Duration // GPU time the enforcer accounted over Window
	Tolerance     time.Duration // the excess allowed over Window
}

// Violation is one instance (or process) found over its quota.
type Violation struct {
	Kind     Kind
	Instance string // "" for KindUnattributed
	PIDs     []int  // the processes involved (host pids), ascending
	Evidence Evidence
	Action   Action
	// First is set on the first check of an episode: the violation was not
	// reported by the previous check that judged its kind.
	First bool
	// Killed lists the processes signalled by this check (ActionKill). A
	// process is signalled once; a violation that persists while it dies
	// kills nothing more.
	Killed []int
	// KillErr joins the errors of kills that failed (not of processes that
	// had already exited).
	KillErr error
}

// Key identifies an episode: a violation that persists from check to check.
type Key struct {
	Kind     Kind
	Instance string
	PID      int // KindUnattributed only: each process is its own episode
}

func (v Violation) key() Key {
	k := Key{Kind: v.Kind, Instance: v.Instance}
	if v.Kind == KindUnattributed && len(v.PIDs) > 0 {
		k.PID = v.PIDs[0]
	}
	return k
}

// String describes the violation in one line.
func (v Violation) String() string {
	e := v.Evidence
	switch v.Kind {
	case KindMemory:
		slack := fmt.Sprintf("allowance %d × %d processes", e.Allowance, e.Processes)
		if e.Processes > e.AllowanceCap {
			slack = fmt.Sprintf("allowance %d × %d: it counts for at most %d of the instance's %d processes", e.Allowance, e.AllowanceCap, e.AllowanceCap, e.Processes)
		}
		return fmt.Sprintf("instance %q: processes %v hold %d bytes of device memory, over its limit of %d (quota %d + %s)",
			v.Instance, v.PIDs, e.UsedMemory, e.MemoryLimit, e.MemoryQuota, slack)
	case KindCompute:
		return fmt.Sprintf("instance %q: processes %v were busy %v on the device over %v, %v accounted (tolerance %v)",
			v.Instance, v.PIDs, e.DriverTime, e.Window, e.AccountedTime, e.Tolerance)
	}
	return fmt.Sprintf("process %v uses the device (%d bytes, busy %v in the last interval) and belongs to no instance",
		v.PIDs, e.UsedMemory, e.DriverTime)
}

// Count is what happened to one instance for one kind, for metrics.
type Count struct {
	Kind     Kind
	Instance string // "" for unattributed processes
	// Episodes counts violations that began (a violation that persists is
	// one episode).
	Episodes uint64
	// Kills counts processes signalled.
	Kills uint64
}

type options struct {
	window    time.Duration
	tolerance int
	allowance uint64
	allowCap  int
	actions   map[Kind]Action
	killer    Killer
	procs     Procs
	log       *slog.Logger
}

// Option configures New.
type Option func(*options)

// WithWindow sets the window the compute check judges over (default
// DefaultWindow).
func WithWindow(d time.Duration) Option { return func(o *options) { o.window = d } }

// WithComputeTolerance sets how much longer than accounted, in percent of
// the window, the instance may have been busy (default
// DefaultTolerancePercent).
func WithComputeTolerance(percent int) Option { return func(o *options) { o.tolerance = percent } }

// WithMemoryAllowance sets the bytes allowed per process on top of the
// quota (default 0): real drivers charge every context some hundred MiB of
// their own, which the shim does not count.
func WithMemoryAllowance(bytes uint64) Option { return func(o *options) { o.allowance = bytes } }

// WithAllowanceProcesses sets the most processes of one instance the
// memory allowance counts for (default DefaultAllowanceProcesses, at least
// 1): the instance's limit is quota + allowance × min(processes, n), so its
// slack over the quota does not grow with the processes it starts.
func WithAllowanceProcesses(n int) Option { return func(o *options) { o.allowCap = n } }

// WithAction sets the action for a kind (defaults: DefaultMemoryAction,
// DefaultComputeAction, DefaultUnattributedAction).
func WithAction(k Kind, a Action) Option { return func(o *options) { o.actions[k] = a } }

// WithKiller sets the Killer (default NewPidfdKiller()).
func WithKiller(k Killer) Option { return func(o *options) { o.killer = k } }

// WithProcs sets where start times are read (default the host's /proc).
func WithProcs(p Procs) Option { return func(o *options) { o.procs = p } }

// WithLogger sets the logger of episodes and kills (default: discard). A
// violation is logged when its episode begins and when it ends, a kill when
// it is made, a failing source when it begins and ends failing.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// Watcher checks one device. Check and Counts may be called from different
// goroutines.
type Watcher struct {
	o   options
	src Source

	mu       sync.Mutex
	pids     map[int]*pidState
	insts    map[string]*instState
	episodes map[Key]time.Duration // active episodes: when they began
	counts   map[Key]*Count        // Key.PID is 0
	failing  bool                  // the source failed at the previous check
}

type pidState struct {
	start    uint64
	instance string
	ok       bool          // attribute named an instance
	seen     time.Duration // last check it was seen alive
	busy     time.Duration // last check it had GPU time
	mem      uint64        // device memory at the last check, bytes
	killed   bool          // signalled (or tried): never again
}

type instState struct {
	driver   time.Duration // cumulative busy time of its processes
	acc      time.Duration // cumulative accounted time, made monotonic
	lastRaw  time.Duration // Instance.Accounted at the previous check
	hasRaw   bool
	points   []point
	lastSeen time.Duration
}

type point struct{ at, driver, acc time.Duration }

// New returns a Watcher of the device src describes.
func New(src Source, opts ...Option) (*Watcher, error) {
	o := options{
		window:    DefaultWindow,
		tolerance: DefaultTolerancePercent,
		allowance: DefaultMemoryAllowance,
		allowCap:  DefaultAllowanceProcesses,
		actions: map[Kind]Action{
			KindMemory:       DefaultMemoryAction,
			KindCompute:      DefaultComputeAction,
			KindUnattributed: DefaultUnattributedAction,
		},
	}
	for _, opt := range opts {
		opt(&o)
	}
	if src == nil {
		return nil, errors.New("backstop: no source")
	}
	if o.window <= 0 {
		return nil, fmt.Errorf("backstop: window %v: must be positive", o.window)
	}
	if o.allowCap < 1 {
		return nil, fmt.Errorf("backstop: allowance processes %d: must be at least 1", o.allowCap)
	}
	if o.tolerance < 0 || o.tolerance > 100 {
		return nil, fmt.Errorf("backstop: compute tolerance %d%%: must be 0..100", o.tolerance)
	}
	for k, a := range o.actions {
		if !slices.Contains(Kinds, k) {
			return nil, fmt.Errorf("backstop: unknown kind %q", k)
		}
		if _, err := ParseAction(string(a)); err != nil {
			return nil, fmt.Errorf("backstop: %s: %w", k, err)
		}
	}
	if o.procs == nil {
		o.procs = NewHostProcs(procfs.Host)
	}
	if o.killer == nil {
		o.killer = PidfdKiller{Procs: o.procs}
	}
	if o.log == nil {
		o.log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return &Watcher{
		o: o, src: src,
		pids:     map[int]*pidState{},
		insts:    map[string]*instState{},
		episodes: map[Key]time.Duration{},
		counts:   map[Key]*Count{},
	}, nil
}

// Check samples the device at now (a monotonic time) and judges the
// device's instances (their quotas and the GPU time the enforcer accounted
// for them so far); attribute maps a host pid, whose process started at
// start (clock ticks after boot), to the name of the instance it belongs
// to. It returns the violations found, after acting on them, and an
// error when the source failed: what could still be judged is judged (a
// failing memory query leaves compute alone, and the reverse). Call it
// every interval, from one goroutine at a time.
func (w *Watcher) Check(now time.Duration, instances []Instance, attribute func(pid int, start uint64) (string, bool)) ([]Violation, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	byName := make(map[string]Instance, len(instances))
	for _, in := range instances {
		byName[in.Name] = in
	}
	procs, perr := w.src.Processes()
	busy, berr := w.src.GPUTime()
	err := errors.Join(perr, berr)
	w.logSource(err)

	// Identify the processes alive now, once each.
	alive := map[int]*pidState{}
	look := func(pid int) *pidState {
		if ps, ok := alive[pid]; ok {
			return ps
		}
		alive[pid] = w.identify(now, pid, attribute)
		return alive[pid]
	}
	belongs := func(ps *pidState) bool { _, ok := byName[ps.instance]; return ps.ok && ok }

	var out []Violation
	judged := map[Kind]bool{}
	if perr == nil {
		judged[KindMemory], judged[KindUnattributed] = true, true
		out = append(out, w.memory(procs, look, belongs, byName)...)
	}
	if berr == nil {
		judged[KindCompute] = true
		out = append(out, w.compute(now, busy, look, instances)...)
	}
	if perr == nil {
		out = append(out, w.unattributed(procs, busy, look, belongs)...)
	}
	slices.SortFunc(out, func(a, b Violation) int {
		ka, kb := a.key(), b.key()
		return cmp.Or(cmp.Compare(ka.Kind, kb.Kind), cmp.Compare(ka.Instance, kb.Instance), cmp.Compare(ka.PID, kb.PID))
	})
	for i := range out {
		w.act(now, &out[i], alive)
	}
	w.endEpisodes(now, out, judged)
	w.prune(now, byName)
	return out, err
}

// identify reads pid's start time, attributes it and reads the start time
// again: a process that exited or whose pid was reused meanwhile is not
// judged (nil).
func (w *Watcher) identify(now time.Duration, pid int, attribute func(int, uint64) (string, bool)) *pidState {
	if pid <= 0 {
		return nil
	}
	st, err := w.o.procs.StartTime(pid)
	if err != nil {
		return nil
	}
	name, ok := attribute(pid, st)
	if st2, err := w.o.procs.StartTime(pid); err != nil || st2 != st {
		return nil
	}
	ps := w.pids[pid]
	if ps == nil || ps.start != st {
		ps = &pidState{start: st}
		w.pids[pid] = ps
	}
	ps.instance, ps.ok, ps.seen = name, ok, now
	return ps
}

func (w *Watcher) memory(procs []Process, look func(int) *pidState, belongs func(*pidState) bool, byName map[string]Instance) []Violation {
	type usage struct {
		used  uint64
		procs []Process
	}
	per := map[string]*usage{}
	for _, p := range procs {
		ps := look(p.PID)
		if ps == nil || !belongs(ps) || p.MemoryUnknown {
			continue
		}
		u := per[ps.instance]
		if u == nil {
			u = &usage{}
			per[ps.instance] = u
		}
		ps.mem = p.UsedMemory
		u.used = satAdd(u.used, p.UsedMemory)
		u.procs = append(u.procs, p)
	}
	var out []Violation
	for name, u := range per {
		in := byName[name]
		limit := w.memoryLimit(in.MemoryQuota, len(u.procs))
		if u.used <= limit {
			continue
		}
		v := Violation{Kind: KindMemory, Instance: name, Action: w.o.actions[KindMemory],
			Evidence: Evidence{UsedMemory: u.used, MemoryQuota: in.MemoryQuota, MemoryLimit: limit,
				Allowance: w.o.allowance, AllowanceCap: w.o.allowCap, Processes: len(u.procs)}}
		for _, p := range u.procs {
			v.PIDs = append(v.PIDs, p.PID)
		}
		slices.Sort(v.PIDs)
		out = append(out, v)
	}
	return out
}

// memoryLimit is the most device memory an instance with quota and n
// processes may hold: the quota, plus the allowance for each process (the
// driver's own memory of its context, which the shim does not count) up to
// the cap. Past the cap, more processes add nothing, so the slack of
// processes that skip the shim is bounded per instance.
func (w *Watcher) memoryLimit(quota uint64, n int) uint64 {
	return satAdd(quota, satMul(w.o.allowance, uint64(min(n, w.o.allowCap)))) //nolint:gosec // min(n, cap) ≥ 0
}

func (w *Watcher) compute(now time.Duration, busy map[int]time.Duration, look func(int) *pidState, instances []Instance) []Violation {
	drv := map[string]time.Duration{}
	for pid, d := range busy {
		if d <= 0 {
			continue
		}
		ps := look(pid)
		if ps == nil {
			// Exited since: its samples still count for the instance it
			// was last attributed to.
			ps = w.pids[pid]
		}
		if ps == nil || !ps.ok {
			continue
		}
		ps.busy = now
		drv[ps.instance] += d
	}
	var out []Violation
	done := map[string]bool{}
	for _, in := range instances {
		if done[in.Name] {
			continue // listed twice: judged once
		}
		done[in.Name] = true
		is := w.insts[in.Name]
		if is == nil {
			is = &instState{}
			w.insts[in.Name] = is
		}
		is.lastSeen = now
		is.driver += drv[in.Name]
		last := len(is.points) - 1
		if is.hasRaw {
			grow := max(in.Accounted-is.lastRaw, 0)
			if last >= 0 {
				grow = min(grow, max(now-is.points[last].at, 0))
			}
			is.acc += grow
		}
		is.lastRaw, is.hasRaw = in.Accounted, true
		if last >= 0 && now <= is.points[last].at {
			continue
		}
		is.points = append(is.points, point{at: now, driver: is.driver, acc: is.acc})
		// The newest point at or before now-window is the base; older
		// ones are no longer needed. Until a point is that old, the
		// window is not full and nothing is judged.
		cut := now - w.o.window
		i := -1
		for j, p := range is.points {
			if p.at <= cut {
				i = j
			}
		}
		if i < 0 {
			continue
		}
		is.points = is.points[i:]
		b := is.points[0]
		span := now - b.at
		d, a := is.driver-b.driver, is.acc-b.acc
		tol := span * time.Duration(w.o.tolerance) / 100
		if d <= a+tol {
			continue
		}
		v := Violation{Kind: KindCompute, Instance: in.Name, Action: w.o.actions[KindCompute],
			Evidence: Evidence{Window: span, DriverTime: d, AccountedTime: a, Tolerance: tol}}
		for pid, ps := range w.pids {
			if ps.ok && ps.instance == in.Name && ps.busy > b.at {
				v.PIDs = append(v.PIDs, pid)
			}
		}
		slices.Sort(v.PIDs)
		out = append(out, v)
	}
	return out
}

func (w *Watcher) unattributed(procs []Process, busy map[int]time.Duration, look func(int) *pidState, belongs func(*pidState) bool) []Violation {
	mem := map[int]uint64{}
	for _, p := range procs {
		mem[p.PID] = satAdd(mem[p.PID], p.UsedMemory)
	}
	for pid, d := range busy {
		if _, ok := mem[pid]; !ok && d > 0 {
			mem[pid] = 0
		}
	}
	var out []Violation
	for pid, m := range mem {
		ps := look(pid)
		if ps == nil || belongs(ps) {
			continue
		}
		out = append(out, Violation{Kind: KindUnattributed, PIDs: []int{pid}, Action: w.o.actions[KindUnattributed],
			Evidence: Evidence{UsedMemory: m, DriverTime: busy[pid]}})
	}
	return out
}

// act marks the episode, counts, kills and logs.
func (w *Watcher) act(now time.Duration, v *Violation, alive map[int]*pidState) {
	k := v.key()
	if _, ok := w.episodes[k]; !ok {
		w.episodes[k] = now
		v.First = true
		w.count(v).Episodes++
		w.o.log.Warn("backstop: violation", "kind", v.Kind, "instance", v.Instance, "pids", v.PIDs,
			"action", v.Action, "evidence", v.String())
	}
	if v.Action != ActionKill {
		return
	}
	for _, t := range w.targets(v, alive) {
		ps := alive[t.PID]
		ps.killed = true
		err := w.o.killer.Kill(t)
		switch {
		case err == nil:
			v.Killed = append(v.Killed, t.PID)
			w.count(v).Kills++
		case errors.Is(err, os.ErrProcessDone):
		default:
			v.KillErr = errors.Join(v.KillErr, err)
		}
	}
	if len(v.Killed) > 0 || v.KillErr != nil {
		w.o.log.Warn("backstop: killed", "kind", v.Kind, "instance", v.Instance, "pids", v.Killed, "error", v.KillErr)
	}
	if v.Kind == KindCompute && len(v.Killed) > 0 {
		// Judge the instance afresh: the killed processes' time must
		// not be held against the ones that follow.
		if is := w.insts[v.Instance]; is != nil {
			is.points = is.points[len(is.points)-1:]
		}
	}
}

// targets are the processes of v to kill, each once. Memory: the largest
// first, until what the others hold is within the limit of the others
// (processes killed before count as gone). Compute and unattributed: all of
// them.
func (w *Watcher) targets(v *Violation, alive map[int]*pidState) []Target {
	var out []Target
	if v.Kind != KindMemory {
		for _, pid := range v.PIDs {
			if ps := alive[pid]; ps != nil && !ps.killed {
				out = append(out, Target{PID: pid, StartTime: ps.start})
			}
		}
		return out
	}
	rest := v.Evidence.UsedMemory
	var cand []int
	for _, pid := range v.PIDs {
		switch ps := alive[pid]; {
		case ps == nil:
		case ps.killed:
			rest -= min(rest, ps.mem)
		default:
			cand = append(cand, pid)
		}
	}
	slices.SortStableFunc(cand, func(a, b int) int { return cmp.Compare(alive[b].mem, alive[a].mem) })
	left := len(cand)
	for _, pid := range cand {
		if rest <= w.memoryLimit(v.Evidence.MemoryQuota, left) {
			break
		}
		ps := alive[pid]
		out = append(out, Target{PID: pid, StartTime: ps.start})
		rest -= min(rest, ps.mem)
		left--
	}
	return out
}

func (w *Watcher) count(v *Violation) *Count {
	k := Key{Kind: v.Kind, Instance: v.Instance}
	c := w.counts[k]
	if c == nil {
		c = &Count{Kind: v.Kind, Instance: v.Instance}
		w.counts[k] = c
	}
	return c
}

// endEpisodes ends the episodes of the kinds judged now that were not
// reported.
func (w *Watcher) endEpisodes(now time.Duration, out []Violation, judged map[Kind]bool) {
	current := map[Key]bool{}
	for i := range out {
		current[out[i].key()] = true
	}
	for k, since := range w.episodes {
		if current[k] || !judged[k.Kind] {
			continue
		}
		delete(w.episodes, k)
		w.o.log.Info("backstop: violation ended", "kind", k.Kind, "instance", k.Instance, "pid", k.PID, "after", now-since)
	}
}

// prune forgets processes not seen for a while and instances that are gone.
func (w *Watcher) prune(now time.Duration, byName map[string]Instance) {
	retain := max(2*w.o.window, minRetain)
	for pid, ps := range w.pids {
		if now-max(ps.seen, ps.busy) > retain {
			delete(w.pids, pid)
		}
	}
	for name := range w.insts {
		if _, ok := byName[name]; !ok {
			delete(w.insts, name)
		}
	}
}

func (w *Watcher) logSource(err error) {
	switch {
	case err != nil && !w.failing:
		w.o.log.Warn("backstop: driver query failing", "error", err)
	case err == nil && w.failing:
		w.o.log.Info("backstop: driver query works again")
	}
	w.failing = err != nil
}

// Counts returns the counts of every instance and kind with a violation so
// far, by kind and instance.
func (w *Watcher) Counts() []Count {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]Count, 0, len(w.counts))
	for _, c := range w.counts {
		out = append(out, *c)
	}
	slices.SortFunc(out, func(a, b Count) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(a.Instance, b.Instance))
	})
	return out
}

func satAdd(a, b uint64) uint64 {
	if a+b < a {
		return ^uint64(0)
	}
	return a + b
}

func satMul(a, b uint64) uint64 {
	if a != 0 && b > ^uint64(0)/a {
		return ^uint64(0)
	}
	return a * b
}
