package harness

import (
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/test/fakecuda"
)

// A request's delay is the other processes' kernel time between its first
// launch and the end of its own last kernel: not what ran before it
// started, nor what ran after its last kernel ended and before its wait
// returned.
func TestDeviceDelays(t *testing.T) {
	const srv, off, other = 1, 2, 3
	runs := []fakecuda.KernelRun{
		{From: 900, To: 1100, Pid: off},  // 100 of it inside the first request
		{From: 1100, To: 1300, Pid: srv}, // the first request's kernels
		{From: 1300, To: 1500, Pid: off},
		{From: 1500, To: 1700, Pid: srv},
		{From: 1700, To: 1900, Pid: off},   // after its last kernel: not counted
		{From: 2000, To: 2200, Pid: other}, // the second request: a process not asked about
		{From: 2200, To: 2400, Pid: srv},
	}
	reqs := []Request{{1000, 1950}, {2000, 2500}, {3000, 3500}}
	is := func(p int) func(int) bool { return func(q int) bool { return q == p } }
	d, err := DeviceDelays(runs, is(srv), is(off), reqs[:2], 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := []time.Duration{300, 0}; len(d) != 2 || d[0] != want[0] || d[1] != want[1] {
		t.Errorf("delays %v, want %v", d, want)
	}
	if d, err := DeviceDelays(runs, is(srv), is(off), reqs[:2], 1500); err != nil || len(d) != 1 {
		t.Errorf("a window from 1500: %v, %v; want the second request only", d, err)
	}
	if _, err := DeviceDelays(runs, is(srv), is(off), reqs, 0); err == nil || !strings.Contains(err.Error(), "no kernel") {
		t.Errorf("a request without kernels in the record: %v, want an error", err)
	}
}

func TestParseRequests(t *testing.T) {
	rs, err := ParseRequests("start mono_ns=5\nlat_us=3\nreq start_ns=10 done_ns=20\nreq start_ns=30 done_ns=45\n")
	if err != nil || len(rs) != 2 || rs[1] != (Request{30, 45}) {
		t.Errorf("%v, %v", rs, err)
	}
	if _, err := ParseRequests("req start_ns=30 done_ns=20\n"); err == nil {
		t.Error("a request done before it started: no error")
	}
	if p := Percentiles([]time.Duration{5, 1, 4, 2, 3}, 50, 100, 1); p[0] != 3 || p[1] != 5 || p[2] != 1 {
		t.Errorf("Percentiles: %v", p)
	}
}
