package enforcer

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// The enforcer keeps one blank region ready so that a create (which a
// container start waits for) is a rename; the blank is made again after
// each create, removed at stop, and a stale one is replaced at start.
func TestBlankRegionAhead(t *testing.T) {
	env := newEnv(t, nil)
	blank := filepath.Join(env.runDir(), "regions", blankName)
	// A stale blank from a crashed enforcer, with a file no blank has.
	if err := os.MkdirAll(blank, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(blank, "junk"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	ready := func() bool {
		ents, err := os.ReadDir(blank)
		return err == nil && len(ents) == 1 && ents[0].Name() == region.ControlName
	}
	_, stop := env.start(t)
	eventually(t, 5*time.Second, "a blank region (its control file)", ready)
	if _, err := os.Stat(filepath.Join(blank, "junk")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the stale blank region was kept: %v", err)
	}

	c := env.client()
	for i := range 3 {
		s := startSleeper(t, nil)
		out, err := c.Create(ctx, tree(s.Process.Pid, 10, 512))
		if err != nil {
			t.Fatal(err)
		}
		r := openRegion(t, out.Instance.Region)
		if p := r.Params(); p.InstanceID != uint32(i) || p.Core != 10 || p.MemoryLimit != 512<<20 { //nolint:gosec // small
			t.Fatalf("instance %d region header %+v", i, p)
		}
		eventually(t, 5*time.Second, "the next blank region", ready)
	}
	stop()
	if _, err := os.Stat(blank); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the blank region outlived the enforcer: %v", err)
	}
	if _, err := region.Open(filepath.Join(env.runDir(), "regions", "mgpu0inst2")); err != nil {
		t.Fatalf("an instance's region after stop: %v", err)
	}
}
