// Package arbiterbench drives an arbiter in the steady state its cost is
// measured in (the arbiter package's BenchmarkTick and mgpu-bench's
// arbiter section), so that both time the same thing. Not a test of
// anything: a harness.
package arbiterbench

import (
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
	"github.com/mgpu-dev/mgpu/internal/policy"
)

// Steady is n saturating instances of core max(1, 100/n) under one policy,
// one Tick per simulated millisecond: the holder runs (1 ms of GPU time and
// 20 launches per tick, 1 ms queued), everybody else waits for the grant.
// Between two ticks only the holder's and the previous holder's usage
// change, as the enforcer rewrites only the entries that changed, so the
// harness costs O(1) per tick.
type Steady struct {
	A *arbiter.Arbiter
	// Next: call NextDecision after every Tick, as the enforcer does.
	Next  bool
	usage map[int]arbiter.Usage
	now   time.Duration
	prev  int
}

// NewSteady returns the steady state of n instances under p, warmed up by
// 1,000 ticks.
func NewSteady(p policy.Policy, n int) *Steady {
	s := &Steady{A: arbiter.New(arbiter.Config{Policy: p}), usage: make(map[int]arbiter.Usage, n), prev: -1}
	for i := range n {
		s.A.Add(i, max(1, 100/n))
		s.usage[i] = arbiter.Usage{Waiting: true}
	}
	for range 1000 {
		s.Step()
	}
	return s
}

// Step is one tick and the usage it leads to.
func (s *Steady) Step() {
	const ms = time.Millisecond
	s.now += ms
	g := s.A.Tick(s.now, s.usage)
	if s.Next {
		s.A.NextDecision()
	}
	cur := -1
	if len(g) > 0 {
		cur = g[0]
	}
	if s.prev >= 0 && s.prev != cur {
		u := s.usage[s.prev]
		u.Waiting, u.Queued = true, 0
		s.usage[s.prev] = u
	}
	if cur >= 0 {
		u := s.usage[cur]
		u.GPUTime += ms
		u.Launches += 20
		u.Queued, u.Waiting = ms, false
		s.usage[cur] = u
	}
	s.prev = cur
}
