package procfs

import (
	"errors"
	"os"
	"reflect"
	"testing"
)

func TestParseStat(t *testing.T) {
	t.Parallel()
	rest := " 100 100 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 1000 100 0"
	for _, tc := range []struct {
		name string
		in   string
		want Stat
		err  bool
	}{
		{"plain", "42 (sleep) S 7" + rest, Stat{State: 'S', PPID: 7, StartTime: 777}, false},
		{"comm with spaces and parens", "42 (a) b (c)) Z 1" + rest, Stat{State: 'Z', PPID: 1, StartTime: 777}, false},
		{"no comm", "42 sleep S 7" + rest, Stat{}, true},
		{"short", "42 (x) S 7 1 2", Stat{}, true},
		{"bad ppid", "42 (x) S -3" + rest, Stat{}, true},
		{"bad state", "42 (x) SS 3" + rest, Stat{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseStat([]byte(tc.in))
			if (err != nil) != tc.err {
				t.Fatalf("err %v", err)
			}
			if err != nil && !errors.Is(err, ErrMalformed) {
				t.Fatalf("err %v not ErrMalformed", err)
			}
			if got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestSelf(t *testing.T) {
	t.Parallel()
	pid := os.Getpid()
	st, err := Host.Stat(pid)
	if err != nil {
		t.Fatal(err)
	}
	if st.PPID != os.Getppid() || st.StartTime == 0 {
		t.Fatalf("stat %+v, ppid %d", st, os.Getppid())
	}
	if ns, err := Host.PidNS(pid); err != nil || ns == 0 {
		t.Fatalf("pid ns %d, %v", ns, err)
	}
	if cg, err := Host.Cgroups(pid); err != nil || len(cg) == 0 {
		t.Fatalf("cgroups %v, %v", cg, err)
	}
	if _, err := Host.Stat(1 << 30); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing pid: %v", err)
	}
}

func TestCgroups(t *testing.T) {
	t.Parallel()
	got, err := ParseCgroups([]byte("12:cpu,cpuacct:/a/b/\n1:name=systemd:/a/b\n0::/x/../c\n"))
	if err != nil || !reflect.DeepEqual(got, []string{"/a/b", "/c"}) {
		t.Fatalf("got %q, %v", got, err)
	}
	for _, bad := range []string{"", "0::relative\n", "garbage\n"} {
		if _, err := ParseCgroups([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	for _, tc := range []struct {
		p, base string
		want    bool
	}{
		{"/a/b", "/a/b", true}, {"/a/b/c", "/a/b", true}, {"/a/bc", "/a/b", false},
		{"/a", "/a/b", false}, {"/a", "/", false}, {"/a", "", false},
	} {
		if Under(tc.p, tc.base) != tc.want {
			t.Errorf("Under(%q, %q) != %v", tc.p, tc.base, tc.want)
		}
	}
	if v, err := ParseNSLink("pid:[4026531836]", "pid"); err != nil || v != 4026531836 {
		t.Fatalf("ns %d %v", v, err)
	}
	for _, bad := range []string{"net:[1]", "pid:[x]", "pid:[0]", "pid:[1"} {
		if _, err := ParseNSLink(bad, "pid"); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("42 (sleep) S 7 100 100 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 1000"))
	f.Add([]byte("1 ()) R 0"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = ParseStat(b)
		_, _ = ParseCgroups(b)
	})
}
