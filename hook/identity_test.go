package hook

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestParseStat(t *testing.T) {
	t.Parallel()
	rest := "S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10"
	tests := []struct {
		name      string
		in        string
		state     byte
		startTime uint64
		wantErr   string
	}{
		{name: "plain", in: "4242 (sh) " + rest, state: 'S', startTime: 987654},
		{name: "comm with spaces and parens", in: "4242 (a) b (c)) " + rest + "\n", state: 'S', startTime: 987654},
		{name: "zombie", in: "7 (x) Z" + rest[1:], state: 'Z', startTime: 987654},
		{name: "no parens", in: "4242 sh " + rest, wantErr: "no command name"},
		{name: "paren order", in: "4242 )sh( " + rest, wantErr: "no command name"},
		{name: "short", in: "4242 (sh) S 1 2", wantErr: "fields after the command name"},
		{name: "starttime not a number", in: "1 (sh) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 x", wantErr: `starttime "x"`},
		{name: "state two letters", in: "1 (sh) SS" + rest[1:], wantErr: "state"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			state, st, err := ParseStat([]byte(tt.in))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || state != tt.state || st != tt.startTime {
				t.Fatalf("got %c %d %v, want %c %d", state, st, err, tt.state, tt.startTime)
			}
		})
	}
}

func TestParseCgroup(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		in      string
		want    string
		wantErr string
	}{
		{name: "v2", in: "0::/system.slice/containerd.service/kubepods-pod1.slice:cri-containerd:abc\n", want: "/system.slice/containerd.service/kubepods-pod1.slice:cri-containerd:abc"},
		{name: "v2 root", in: "0::/\n", want: "/"},
		{name: "hybrid prefers the unified hierarchy",
			in:   "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n",
			want: "/docker/abc"},
		{name: "v1 memory first",
			in:   "12:pids:/p\n4:memory:/m\n3:cpu,cpuacct:/c\n1:name=systemd:/s\n",
			want: "/m"},
		{name: "v1 cpu from a joint mount", in: "3:cpuacct,cpu:/c\n1:name=systemd:/s\n", want: "/c"},
		{name: "v1 unknown controllers only", in: "5:net_cls,net_prio:/n\n6:freezer:/f\n", want: "/n"},
		{name: "empty", in: "", wantErr: "no cgroup entries"},
		{name: "garbage", in: "hello\n", wantErr: "not hierarchy:controllers:path"},
		{name: "one colon", in: "0:/x\n", wantErr: "not hierarchy:controllers:path"},
		{name: "bad id", in: "x::/a\n", wantErr: `hierarchy id "x"`},
		{name: "relative", in: "0::a\n", wantErr: `path "a" is not absolute`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseCgroup([]byte(tt.in))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// fakeProc builds a procfs tree with one process.
func fakeProc(t *testing.T, pid int, stat, cgroup, nsLink, selfNS string) Proc {
	t.Helper()
	root := t.TempDir()
	dir := filepath.Join(root, strconv.Itoa(pid))
	for _, d := range []string{filepath.Join(dir, "ns"), filepath.Join(root, "self", "ns")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p, s string) {
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(dir, "stat"), stat)
	write(filepath.Join(dir, "cgroup"), cgroup)
	if err := os.Symlink(nsLink, filepath.Join(dir, "ns", "pid")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(selfNS, filepath.Join(root, "self", "ns", "pid")); err != nil {
		t.Fatal(err)
	}
	return Proc{Root: root}
}

func statLine(pid int, state byte, start uint64) string {
	return fmt.Sprintf("%d (init) %c 0 %d %d 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 %d 1000 10\n", pid, state, pid, pid, start)
}

func TestIdentityFakeProc(t *testing.T) {
	t.Parallel()
	p := fakeProc(t, 77, statLine(77, 'S', 5555), "0::/mgpu/test\n", "pid:[4026532000]", "pid:[4026531836]")
	id, err := p.Identity(77)
	if err != nil {
		t.Fatal(err)
	}
	want := Identity{Pid: 77, StartTime: 5555, PidNS: 4026532000, Cgroup: "/mgpu/test"}
	if id != want {
		t.Fatalf("got %+v, want %+v", id, want)
	}
	if !p.Alive(77, 5555) || p.Alive(77, 5556) || p.Alive(78, 5555) || p.Alive(0, 0) {
		t.Fatal("Alive disagrees with the process table")
	}

	host := fakeProc(t, 9, statLine(9, 'R', 1), "0::/\n", "pid:[4026531836]", "pid:[4026531836]")
	if id, err := host.Identity(9); err != nil || !id.HostPidNS {
		t.Fatalf("shared pid namespace not detected: %+v %v", id, err)
	}

	zombie := fakeProc(t, 5, statLine(5, 'Z', 1), "0::/\n", "pid:[1]", "pid:[2]")
	if _, err := zombie.Identity(5); !errors.Is(err, ErrProcessGone) {
		t.Fatalf("zombie: got %v, want ErrProcessGone", err)
	}
	if zombie.Alive(5, 1) {
		t.Fatal("a zombie is not alive")
	}
	if _, err := zombie.Identity(6); !errors.Is(err, ErrProcessGone) {
		t.Fatalf("missing pid: got %v, want ErrProcessGone", err)
	}
	if _, err := zombie.Identity(0); err == nil {
		t.Fatal("pid 0 accepted")
	}
	badNS := fakeProc(t, 3, statLine(3, 'S', 1), "0::/\n", "net:[1]", "pid:[2]")
	if _, err := badNS.Identity(3); err == nil || !strings.Contains(err.Error(), "not pid:[inode]") {
		t.Fatalf("bad ns link: %v", err)
	}
}

// TestIdentityHost reads a real child process from the host's /proc.
func TestIdentityHost(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start sleep: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	id, err := HostProc.Identity(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	self, err := HostProc.Identity(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if id.Pid != cmd.Process.Pid || id.StartTime == 0 || id.PidNS == 0 || !strings.HasPrefix(id.Cgroup, "/") {
		t.Fatalf("implausible identity %+v", id)
	}
	if id.PidNS != self.PidNS || !id.HostPidNS || id.Cgroup != self.Cgroup {
		t.Fatalf("a child shares our pid namespace and cgroup: child %+v, self %+v", id, self)
	}
	if !HostProc.Alive(id.Pid, id.StartTime) || HostProc.Alive(id.Pid, id.StartTime+1) {
		t.Fatal("Alive disagrees with /proc")
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if HostProc.Alive(id.Pid, id.StartTime) {
		t.Fatal("a reaped process is alive")
	}
}

func FuzzParseCgroup(f *testing.F) {
	f.Add([]byte("0::/a\n"))
	f.Add([]byte("12:memory:/m\n1:name=systemd:/s\n0::/u\n"))
	f.Add([]byte("3:cpu,cpuacct:/c"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := ParseCgroup(data)
		if err == nil && !strings.HasPrefix(p, "/") {
			t.Fatalf("accepted non-absolute path %q", p)
		}
		if err == nil && !strings.Contains(string(data), p) {
			t.Fatalf("path %q not in the input", p)
		}
	})
}

func FuzzParseStat(f *testing.F) {
	f.Add([]byte(statLine(1, 'S', 42)))
	f.Add([]byte("1 (a) b)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"))
	f.Fuzz(func(t *testing.T, data []byte) {
		state, st, err := ParseStat(data)
		if err != nil {
			return
		}
		after := string(data[strings.LastIndexByte(string(data), ')')+1:])
		if !strings.Contains(after, strconv.FormatUint(st, 10)) || strings.IndexByte(after, state) < 0 || !isLetter(state) {
			t.Fatalf("state %q start time %d are not in %q", state, st, after)
		}
	})
}
