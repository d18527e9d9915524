package device

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/internal/config"
)

func simConfig(t *testing.T, gpus int) *config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.Backend = config.BackendSim
	cfg.RunDir = t.TempDir()
	for i := 0; i < gpus; i++ {
		cfg.Sim.GPUs = append(cfg.Sim.GPUs, config.SimGPU{Name: "sim", MemoryMiB: 1024, UUID: config.SimUUID(i)})
	}
	return cfg
}

func TestEnsureSimNodes(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("creating device nodes needs root")
	}
	cfg := simConfig(t, 3)
	paths, err := EnsureSimNodes(cfg)
	if errors.Is(err, ErrNeedRoot) {
		t.Skipf("mknod not permitted here (user namespace?): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	dir := SimNodeDir(cfg)
	want := []string{"nvidia0", "nvidia1", "nvidia2", "nvidiactl"}
	if len(paths) != len(want) {
		t.Fatalf("paths = %v, want %v under %s", paths, want, dir)
	}
	inodes := map[string]uint64{}
	for i, p := range paths {
		if p != filepath.Join(dir, want[i]) {
			t.Errorf("path %d = %s, want %s", i, p, filepath.Join(dir, want[i]))
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != SimNodeMajor || unix.Minor(st.Rdev) != SimNodeMinor {
			t.Errorf("%s: mode %o rdev %d:%d, want a character device %d:%d", p, st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev), SimNodeMajor, SimNodeMinor)
		}
		if st.Mode&0o777 != 0o666 {
			t.Errorf("%s: permissions %o, want 666", p, st.Mode&0o777)
		}
		inodes[p] = st.Ino
	}
	// The nodes of the sim backend are the ones EnsureSimNodes made.
	devs, _ := NewSim(cfg).Devices()
	for _, d := range devs {
		if _, ok := inodes[d.Nodes[0]]; !ok {
			t.Errorf("device %d node %s was not created", d.Index, d.Nodes[0])
		}
	}

	// Idempotent: a second run keeps the same nodes.
	if _, err := EnsureSimNodes(cfg); err != nil {
		t.Fatalf("second run: %v", err)
	}
	for p, ino := range inodes {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Ino != ino {
			t.Errorf("%s was recreated by the second run", p)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != len(want) {
		t.Errorf("node directory holds %d entries, want %d (temporary files left?)", len(entries), len(want))
	}
}

type failingMknoder struct{ err error }

func (f failingMknoder) Mknod(string, uint32, int) error { return f.err }

func TestEnsureSimNodesWithoutRoot(t *testing.T) {
	t.Parallel()
	cfg := simConfig(t, 1)
	_, err := EnsureSimNodes(cfg, WithMknoder(failingMknoder{unix.EPERM}))
	if !errors.Is(err, ErrNeedRoot) {
		t.Fatalf("err = %v, want ErrNeedRoot", err)
	}
	msg := err.Error()
	if strings.Contains(msg, "\n") || !strings.Contains(msg, filepath.Join(SimNodeDir(cfg), "nvidia0")) || !strings.Contains(msg, "root") {
		t.Errorf("error %q: want one line naming the node and root", msg)
	}
	entries, _ := os.ReadDir(SimNodeDir(cfg))
	if len(entries) != 0 {
		t.Errorf("a failed run left %d entries behind", len(entries))
	}
}

func TestEnsureSimNodesRefusesOtherFiles(t *testing.T) {
	t.Parallel()
	cfg := simConfig(t, 1)
	dir := SimNodeDir(cfg)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "nvidia0")
	if err := os.WriteFile(p, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The fake never gets called for nvidia0; it would succeed for others.
	_, err := EnsureSimNodes(cfg, WithMknoder(failingMknoder{nil}))
	if err == nil || !strings.Contains(err.Error(), "not the character device 1:3") {
		t.Fatalf("err = %v, want a refusal naming the expected device", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "keep me" {
		t.Errorf("the existing file was changed: %q", b)
	}
}
