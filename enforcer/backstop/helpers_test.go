package backstop

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"
)

const (
	mib  = uint64(1) << 20
	tick = 250 * time.Millisecond
)

// rig is a Watcher over fakes, driven by a virtual clock.
type rig struct {
	t      *testing.T
	src    *FakeSource
	procs  *FakeProcs
	killer *FakeKiller
	logs   *records
	w      *Watcher
	owner  map[int]string // pid -> instance
	now    time.Duration
}

func newRig(t *testing.T, opts ...Option) *rig {
	t.Helper()
	r := &rig{t: t, src: &FakeSource{}, procs: NewFakeProcs(nil), killer: &FakeKiller{}, logs: &records{}, owner: map[int]string{}}
	all := append([]Option{WithProcs(r.procs), WithKiller(r.killer), WithLogger(slog.New(r.logs))}, opts...)
	w, err := New(r.src, all...)
	if err != nil {
		t.Fatal(err)
	}
	r.w = w
	return r
}

// proc starts a fake process of instance (""; none) with start time 1000+pid.
func (r *rig) proc(pid int, instance string) {
	r.procs.Start(pid, uint64(1000+pid), true)
	if instance != "" {
		r.owner[pid] = instance
	}
}

func (r *rig) attribute(pid int, _ uint64) (string, bool) {
	in, ok := r.owner[pid]
	return in, ok
}

// check advances the clock by d and checks.
func (r *rig) check(d time.Duration, instances ...Instance) []Violation {
	r.t.Helper()
	r.now += d
	vs, err := r.w.Check(r.now, instances, r.attribute)
	if err != nil {
		r.t.Fatalf("check at %v: %v", r.now, err)
	}
	return vs
}

// records is a slog.Handler that keeps the messages logged.
type records struct {
	mu   sync.Mutex
	msgs []string
}

func (h *records) Enabled(context.Context, slog.Level) bool { return true }
func (h *records) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.msgs = append(h.msgs, r.Message)
	return nil
}
func (h *records) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *records) WithGroup(string) slog.Handler      { return h }

func (h *records) count(msg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, m := range h.msgs {
		if m == msg {
			n++
		}
	}
	return n
}

func kinds(vs []Violation) []Kind {
	var out []Kind
	for _, v := range vs {
		out = append(out, v.Kind)
	}
	return out
}
