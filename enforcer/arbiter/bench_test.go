package arbiter_test

import (
	"testing"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/arbiterbench"
)

// benchTick times one Tick (and NextDecision after it if next) in the
// steady state of n saturating instances (arbiterbench.Steady).
func benchTick(b *testing.B, n int, p policy.Policy, next bool) {
	s := arbiterbench.NewSteady(p, n)
	s.Next = next
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		s.Step()
	}
}

// benchPolicies runs benchTick under fixed-share and native-burst-share.
func benchPolicies(b *testing.B, n int, next bool) {
	for _, p := range []policy.Policy{policy.FixedShare, policy.NativeBurstShare} {
		b.Run(p.String(), func(b *testing.B) { benchTick(b, n, p, next) })
	}
}

func BenchmarkTick16(b *testing.B) { benchPolicies(b, 16, false) }

func BenchmarkTick64(b *testing.B) { benchPolicies(b, 64, false) }

// BenchmarkTickNext16 is BenchmarkTick16 with the enforcer's NextDecision
// after every Tick.
func BenchmarkTickNext16(b *testing.B) { benchPolicies(b, 16, true) }

func BenchmarkTickNext64(b *testing.B) { benchPolicies(b, 64, true) }
