package enforcer

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

// TestInspectAncestors checks how far inspect walks up the process tree:
// to the nearest root of a process-tree instance, and not at all when the
// device has none (containers are matched by namespace and cgroup); that a
// root the enforcer holds a pidfd of is matched by that pidfd, without
// reading its /proc, and only while it lives; and that cgroups are read
// only where a container instance is matched by cgroup and none by the
// process's pid namespace.
func TestInspectAncestors(t *testing.T) {
	t.Parallel()
	live, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(live) })
	gone := exitedPidfd(t)
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
		name    string
		trees   []int // roots of process-tree instances (start time = pid)
		rootFD  int   // their pidfd; 0: none
		other   bool  // a container instance too, matched by cgroup
		byNS    bool  // a container instance of the process's pid namespace
		want    []int
		pinned  bool // the last ancestor is a pinned root
		cgroups bool // the process's cgroups were read
		match   bool
	}{
		{name: "no instance", want: []int{10}},
		{name: "containers only", other: true, want: []int{10}, cgroups: true},
		{name: "container of its namespace", other: true, byNS: true, want: []int{10}, match: true},
		{name: "root is the process", trees: []int{10}, want: []int{10}, match: true},
		{name: "root is the grandparent", trees: []int{8}, other: true, want: []int{10, 9, 8}, cgroups: true, match: true},
		{name: "nearest of two roots", trees: []int{7, 9}, want: []int{10, 9}, match: true},
		{name: "root elsewhere", trees: []int{42}, want: []int{10, 9, 8, 7, 1}},
		{name: "pinned root", trees: []int{8}, rootFD: live, want: []int{10, 9, 8}, pinned: true, match: true},
		{name: "pinned root is the process", trees: []int{10}, rootFD: live, want: []int{10}, match: true},
		{name: "pinned root exited", trees: []int{8}, rootFD: gone, want: []int{10, 9, 8}, pinned: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := &Enforcer{o: options{proc: procfs.FS{Root: root}}}
			for _, pid := range tc.trees {
				in := newInstance()
				in.kind, in.pid, in.startTime = api.KindProcessTree, pid, uint64(pid) //nolint:gosec // small
				if tc.rootFD != 0 {
					in.rootFD = tc.rootFD
				}
				e.list = append(e.list, in)
			}
			if tc.other {
				in := newInstance()
				in.kind, in.cgroup = api.KindContainer, "/other"
				e.list = append(e.list, in)
			}
			if tc.byNS {
				in := newInstance()
				in.kind, in.pidNS = api.KindContainer, 4026531836
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
			if last := p.ancestors[len(p.ancestors)-1]; last.pinned != tc.pinned {
				t.Fatalf("last ancestor %+v, want pinned %v", last, tc.pinned)
			}
			if (p.cgroups != nil) != tc.cgroups {
				t.Fatalf("cgroups %v read, want read: %v", p.cgroups, tc.cgroups)
			}
			if got := e.matchLocked(p) != nil; got != tc.match {
				t.Fatalf("matched %v, want %v", got, tc.match)
			}
		})
	}
}

// exitedPidfd returns a pidfd of a child that has exited and been reaped.
func exitedPidfd(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	_ = cmd.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(fd) })
	return fd
}
