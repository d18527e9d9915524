package tenants

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
	tol "github.com/mgpu-dev/mgpu/test/shares"
)

// TestTamper: a process of a 10 % instance maps what it was given and
// tries every way a process has to make the enforcer's words (quota,
// grant) or another slot writable, as root. Every way to the enforcer's
// words fails, and so does every way to another slot but reopening it
// (docs/tenants.md); the instance's memory stays at its quota and the 10 /
// 90 split holds while the tamperer stays attached.
func TestTamper(t *testing.T) {
	n := newNode(t, harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.FixedShare}})
	a, err := n.Shell(0, 10, 1024)
	if err != nil {
		t.Fatal(err)
	}
	b, err := n.Shell(0, 90, 1024)
	if err != nil {
		t.Fatal(err)
	}
	// Another process of the instance, attached, whose slot the tamperer
	// also goes for.
	holder, err := a.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "64", "--hold-ms", "-1")
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.WaitOutput("holding", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	tp, err := a.SpawnCommand(self(roleTamper)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := tp.WaitOutput("holding", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	out := tp.Output()
	t.Logf("tamperer:\n%s", out)
	m := fakecuda.Fields(out)
	for _, f := range []string{"control", "other"} {
		for k, want := range map[string]string{"mmap": "EACCES", "mprotect": "EACCES", "reopen": "EROFS", "write": "EBADF", "truncate": "EINVAL"} {
			if f == "other" && k == "reopen" {
				// Another slot is a memfd, in no mount that could be
				// read-only: root (CAP_DAC_OVERRIDE) reopens it for
				// writing. It is a process of the same instance, which
				// can write any value into its own slot anyway; the slot
				// stays sealed against resizing (TestRestartUnderResize),
				// and a tenant without CAP_DAC_OVERRIDE gets EACCES
				// (enforcer/region TestSlotSeals).
				want = "ok"
			}
			if got := m["tamper."+f+"."+k]; got != want {
				t.Errorf("tamper.%s.%s=%s, want %s", f, k, got, want)
			}
		}
	}
	if m["tamper.own.mmap"] != "ok" {
		t.Errorf("the own slot is not writable: %s", m["tamper.own.mmap"])
	}

	// Memory: the quota holds for the instance's other processes.
	info, err := a.Spawn("info")
	if err != nil {
		t.Fatal(err)
	}
	if err := info.WaitExit(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	if got := fakecuda.Fields(info.Output())["device.0.total_mem"]; got != strconv.Itoa(1024<<20) {
		t.Errorf("total memory seen in the instance: %s, want %d:\n%s", got, 1024<<20, info.Output())
	}
	big, err := a.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "8192")
	if err != nil {
		t.Fatal(err)
	}
	if err := big.WaitExit(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(big.Output(), "CUDA_ERROR_OUT_OF_MEMORY") {
		t.Errorf("8192 MiB in a 1024 MiB instance:\n%s", big.Output())
	}

	// Compute: the split holds while the tamperer is attached.
	s := saturatedShares(t, n, a, b)
	within(t, "the tamperer's instance (core 10)", s[0], 10)
	within(t, "its neighbour (core 90)", s[1], 90)
	if !tp.Alive() {
		t.Errorf("the tamperer did not stay attached:\n%s", tp.Output())
	}
}

// TestNonsenseCounters: a process that writes random values into its own
// slot as fast as it can: the enforcer keeps running, the other
// instances' shares hold, and the enforcer says so once, naming the
// instance.
func TestNonsenseCounters(t *testing.T) {
	var logs harness.SyncBuffer
	n := newNode(t, harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.FixedShare}, Log: &logs})
	a, err := n.Shell(0, 30, 1024)
	if err != nil {
		t.Fatal(err)
	}
	b, err := n.Shell(0, 60, 1024)
	if err != nil {
		t.Fatal(err)
	}
	c, err := n.Shell(0, 10, 1024)
	if err != nil {
		t.Fatal(err)
	}
	g, err := c.SpawnCommand(self(roleGarbage)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.WaitOutput("garbage", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	s := saturatedShares(t, n, a, b)
	for i, want := range []float64{30, 60} {
		if d := s[i] - want; d < -tol.Normative || d > tol.Normative {
			t.Errorf("instance of core %.0f: %.2f%%, want %.0f ± %.0f", want, s[i], want, tol.Normative)
		}
	}
	if !g.Alive() {
		t.Fatalf("the garbage writer ended:\n%s", g.Output())
	}
	if _, err := n.Client(0).Stats(t.Context()); err != nil {
		t.Fatalf("the enforcer stopped answering: %v", err)
	}
	var warned []string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "reports counters out of range") {
			warned = append(warned, line)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], "instance="+c.Instance.Name) {
		t.Fatalf("warnings %q, want one naming %s", warned, c.Instance.Name)
	}
	t.Logf("the enforcer's line: %s", warned[0])
}
