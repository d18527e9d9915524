// Package process holds the process-level tests: real enforcers on a
// simulated node, workloads under the shim in front of the simulated GPU, no
// containers. Shares are measured from the simulated device's own records.
package process

import (
	"os"
	"testing"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// newNode starts a simulated node with an enforcer per device. Without a
// build it skips locally and fails in CI (CI=true), which always builds.
func newNode(t *testing.T, nc harness.NodeConfig) *harness.Node {
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
