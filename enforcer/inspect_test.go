package enforcer

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

// TestInspectAncestors checks how far inspect walks up the process tree:
// to the nearest root of a process-tree instance, and not at all when the
// device has none (containers are matched by namespace and cgroup).
func TestInspectAncestors(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	parent := map[int]int{10: 9, 9: 8, 8: 7, 7: 1, 1: 0}
	for pid, ppid := range parent {
		d := filepath.Join(root, strconv.Itoa(pid))
		if err := os.MkdirAll(filepath.Join(d, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		// start time = pid; field 22 is the 20th after the command name
		stat := fmt.Sprintf("%d (p %d) S %d %s%d 0\n", pid, pid, ppid, strings.Repeat("0 ", 17), pid)
		if err := os.WriteFile(filepath.Join(d, "stat"), []byte(stat), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "cgroup"), []byte("0::/user.slice\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("pid:[4026531836]", filepath.Join(d, "ns", "pid")); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name  string
		trees []int // roots of process-tree instances (start time = pid)
		other bool  // a container instance too
		want  []int
	}{
		{name: "no instance", want: []int{10}},
		{name: "containers only", other: true, want: []int{10}},
		{name: "root is the process", trees: []int{10}, want: []int{10}},
		{name: "root is the grandparent", trees: []int{8}, other: true, want: []int{10, 9, 8}},
		{name: "nearest of two roots", trees: []int{7, 9}, want: []int{10, 9}},
		{name: "root elsewhere", trees: []int{42}, want: []int{10, 9, 8, 7, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := &Enforcer{o: options{proc: procfs.FS{Root: root}}}
			for _, pid := range tc.trees {
				in := newInstance()
				in.kind, in.pid, in.startTime = api.KindProcessTree, pid, uint64(pid) //nolint:gosec // small
				e.list = append(e.list, in)
			}
			if tc.other {
				in := newInstance()
				in.kind, in.cgroup = api.KindContainer, "/other"
				e.list = append(e.list, in)
			}
			p, err := e.inspect(10)
			if err != nil {
				t.Fatal(err)
			}
			var got []int
			for _, a := range p.ancestors {
				got = append(got, a.pid)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("ancestors %v, want %v", got, tc.want)
			}
			if tc.trees != nil && tc.trees[0] != 42 && e.matchLocked(p) == nil {
				t.Fatalf("no instance matched")
			}
		})
	}
}
