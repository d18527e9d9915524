// Package process holds the process-level tests: real enforcers on a
// simulated node, workloads under the shim in front of the simulated GPU, no
// containers. Shares are measured from the simulated device's own records.
package process

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// newNode starts a simulated node with an enforcer per device. Without a
// build it skips locally and fails in CI (CI=true), which always builds.
func newNode(t testing.TB, nc harness.NodeConfig) *harness.Node {
	t.Helper()
	n, err := harness.NewNode(nc)
	if err != nil {
		if os.Getenv("CI") == "" {
			t.Skipf("%v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	devs := nc.Devices
	if devs == 0 {
		devs = 1
	}
	for d := 0; d < devs; d++ {
		if err := n.StartEnforcer(d); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

// shareCase runs one share case: f starts its node, measures a window and
// checks it. A window that misses a bound is measured once more, on a
// fresh node (the first one closed), and the case is judged on that
// second window; both are logged. On the 2-vCPU CI machine, where the
// workloads, the simulated device's threads and the enforcer share the
// two CPUs, a moment in which the host does not run a workload moves a
// 10 s window by up to 3 points (fixed-share 30/70 of 50 us kernels: the
// device 96.85 % busy and 8 hand-offs a second, where that case keeps it
// 99.5-99.8 % busy with 1-4), about once in a hundred windows. An
// arbiter or accounting that is wrong misses both windows.
func shareCase(t *testing.T, f func(t testing.TB)) {
	t.Helper()
	if errs := shareAttempt(t, f); len(errs) > 0 {
		t.Logf("the window missed: %s; measured once more on a fresh node", strings.Join(errs, "; "))
		for _, e := range shareAttempt(t, f) {
			t.Error(e)
		}
	}
}

// shareAttempt runs f once, returning the errors it reported; the nodes it
// started are closed when it returns (or fails fatally).
func shareAttempt(t *testing.T, f func(t testing.TB)) []string {
	a := &attemptT{T: t}
	defer a.close()
	f(a)
	return a.errs
}

// attemptT is a share case's attempt: its errors are collected rather
// than reported, and its cleanups run when the attempt ends, not the test.
type attemptT struct {
	*testing.T
	errs     []string
	cleanups []func()
}

func (a *attemptT) Errorf(format string, args ...any) {
	a.errs = append(a.errs, fmt.Sprintf(format, args...))
}

func (a *attemptT) Error(args ...any) { a.errs = append(a.errs, fmt.Sprint(args...)) }

func (a *attemptT) Cleanup(f func()) { a.cleanups = append(a.cleanups, f) }

func (a *attemptT) close() {
	for i := len(a.cleanups) - 1; i >= 0; i-- {
		a.cleanups[i]()
	}
}
