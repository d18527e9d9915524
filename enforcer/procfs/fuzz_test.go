package procfs

import (
	"errors"
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// FuzzParseCgroups checks that a cgroup file is read as the cleaned path
// of every line, in order and without duplicates, and reads back the same
// when written again; anything else is ErrMalformed, quoting the line.
func FuzzParseCgroups(f *testing.F) {
	for _, s := range []string{
		"12:cpu,cpuacct:/a/b/\n1:name=systemd:/a/b\n0::/x/../c\n",
		"0::/\n",
		"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n",
		"0::/a:b:c",
		"", "\n\n", "0::relative\n", "garbage\n", "0:/a\n", "0::/a\r\n", "::/\x00",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := ParseCgroups(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) || got != nil {
				t.Fatalf("ParseCgroups(%q) = %q, %v", b, got, err)
			}
			if msg := err.Error(); strings.ContainsAny(msg, "\r\n") {
				t.Fatalf("error of more than one line %q", msg)
			}
			return
		}
		var want []string
		for _, line := range strings.Split(string(b), "\n") {
			if line == "" {
				continue
			}
			parts := strings.SplitN(line, ":", 3)
			if len(parts) != 3 || !strings.HasPrefix(parts[2], "/") {
				t.Fatalf("accepted line %q", line)
			}
			if p := path.Clean(parts[2]); !slices.Contains(want, p) {
				want = append(want, p)
			}
		}
		if len(got) == 0 || !slices.Equal(got, want) {
			t.Fatalf("ParseCgroups(%q) = %q, want %q", b, got, want)
		}
		var again strings.Builder
		for _, p := range got {
			if p != path.Clean(p) || !path.IsAbs(p) {
				t.Fatalf("path %q is not clean and absolute", p)
			}
			fmt.Fprintf(&again, "0::%s\n", p)
		}
		if back, err := ParseCgroups([]byte(again.String())); err != nil || !slices.Equal(back, got) {
			t.Fatalf("%q read back as %q, %v", got, back, err)
		}
	})
}

// FuzzParseNSLink checks that a namespace link is accepted only as
// kind:[N] with N a decimal inode above 0, read as N, and that every such
// link of a formatted inode reads back; anything else is ErrMalformed,
// quoting the link.
func FuzzParseNSLink(f *testing.F) {
	for _, s := range []string{"pid:[4026531836]", "net:[1]", "pid:[x]", "pid:[0]", "pid:[1", "pid:[]", "pid:[007]",
		"pid:[18446744073709551616]", "pid:[+1]", "pid:[1_0]", "pid:[1]]", "pid:[ 1]"} {
		f.Add(s, "pid", uint64(4026531836))
	}
	f.Add("mnt:[4026531841]", "mnt", uint64(0))
	f.Add(":[1]", "", uint64(1<<64-1))
	f.Fuzz(func(t *testing.T, l, kind string, ino uint64) {
		v, err := ParseNSLink(l, kind)
		if err != nil {
			if want := fmt.Sprintf("%v: namespace link %q", ErrMalformed, l); !errors.Is(err, ErrMalformed) || err.Error() != want || v != 0 {
				t.Fatalf("ParseNSLink(%q, %q) = %d, %v", l, kind, v, err)
			}
		} else {
			digits, ok := strings.CutPrefix(l, kind+":[")
			digits, ok2 := strings.CutSuffix(digits, "]")
			if !ok || !ok2 || v == 0 || digits == "" || strings.TrimLeft(digits, "0123456789") != "" ||
				strings.TrimLeft(digits, "0") != strconv.FormatUint(v, 10) {
				t.Fatalf("ParseNSLink(%q, %q) = %d", l, kind, v)
			}
		}
		link := fmt.Sprintf("%s:[%d]", kind, ino)
		v, err = ParseNSLink(link, kind)
		if ino == 0 && err == nil || ino != 0 && (err != nil || v != ino) {
			t.Fatalf("ParseNSLink(%q, %q) = %d, %v", link, kind, v, err)
		}
	})
}
