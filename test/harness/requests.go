package harness

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
)

// FollowKernels starts following device dev's kernel runs (fakecuda's
// record: fakecuda.FollowKernels), read every 100 ms. Stop it.
func (n *Node) FollowKernels(dev int) (*fakecuda.KernelLog, error) {
	return fakecuda.FollowKernels(n.Paths.Ctl, n.FakeState, dev, 100*time.Millisecond)
}

// Request is one request of `mgpu-workload serve --raw`, on
// CLOCK_MONOTONIC (the simulated device's clock): when its first launch
// was called and when its wait for the last kernel returned.
type Request struct{ Start, Done int64 }

var requestLine = regexp.MustCompile(`(?m)^req start_ns=([0-9]+) done_ns=([0-9]+)$`)

// ParseRequests returns the requests `serve --raw` printed, in arrival
// order.
func ParseRequests(out string) ([]Request, error) {
	var rs []Request
	for _, m := range requestLine.FindAllStringSubmatch(out, -1) {
		s, err1 := strconv.ParseInt(m[1], 10, 64)
		d, err2 := strconv.ParseInt(m[2], 10, 64)
		if err1 != nil || err2 != nil || d < s {
			return nil, fmt.Errorf("serve printed a bad request line %q", m[0])
		}
		rs = append(rs, Request{s, d})
	}
	return rs, nil
}

// DeviceDelays returns, for each request of the server (its processes:
// server) that started at or after since (the kernel log's From), the
// device time the kernels of the processes other says yes to ran between
// the request's start and the end of its last kernel on the device (the
// last of the server's kernel runs that ends before its wait returned):
// what those processes' work added to the request on the device's own
// timeline, with nothing of the host's scheduling in it but what held the
// device. A request whose kernels the log does not hold is an error.
func DeviceDelays(runs []fakecuda.KernelRun, server, other func(pid int) bool, reqs []Request, since int64) ([]time.Duration, error) {
	own := fakecuda.NewTimeline(runs, server)
	others := fakecuda.NewTimeline(runs, other)
	var out []time.Duration
	for _, r := range reqs {
		if r.Start < since {
			continue
		}
		end := own.LastEnd(r.Start, r.Done)
		if end == 0 {
			return nil, fmt.Errorf("no kernel of the server's request [%d, %d] in the device's record", r.Start, r.Done)
		}
		out = append(out, time.Duration(others.Within(r.Start, end)))
	}
	return out, nil
}

// OfflineDelayBound is the p99 bound docs/arbiter.md ("Online and offline
// instances") states for the device time offline kernels of length kernel
// add to an online request: under online_offline_switch 2 the one offline
// kernel in flight, under 1 the offline queue bound and a kernel, each with
// 0.1 ms for the enforcer's wake-up.
func OfflineDelayBound(sw int, kernel time.Duration) time.Duration {
	d := kernel + 100*time.Microsecond
	if sw == 1 {
		d += arbiter.DefaultOfflineMaxQueued
	}
	return d
}

// Percentiles returns the p-th percentiles (nearest rank) of v, which it
// sorts.
func Percentiles(v []time.Duration, ps ...float64) []time.Duration {
	sort.Slice(v, func(i, j int) bool { return v[i] < v[j] })
	out := make([]time.Duration, len(ps))
	for i, p := range ps {
		if len(v) == 0 {
			continue
		}
		k := int(float64(len(v))*p/100 + 0.999999)
		out[i] = v[min(max(k, 1), len(v))-1]
	}
	return out
}
