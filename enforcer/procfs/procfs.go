// Package procfs reads what the enforcer needs to know about a process from
// /proc: its parent and start time (/proc/<pid>/stat), its pid namespace
// (/proc/<pid>/ns/pid) and its cgroups (/proc/<pid>/cgroup). The root
// directory is a field so that tests can describe processes in a temporary
// directory.
package procfs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// FS is a proc file system mounted at Root.
type FS struct{ Root string }

// Host is the host's /proc.
var Host = FS{Root: "/proc"}

// Stat is what /proc/<pid>/stat tells about a process.
type Stat struct {
	State     byte   // R, S, D, Z, ...
	PPID      int    // parent pid
	StartTime uint64 // clock ticks after boot
}

// ErrMalformed is returned (wrapped) for a /proc file that cannot be parsed.
var ErrMalformed = errors.New("malformed proc file")

// maxStatSize bounds what is read of a stat file (the comm field is at most
// 64 bytes; the rest is about 52 numbers).
const maxStatSize = 4096

func (fs FS) file(pid int, name string) string {
	return filepath.Join(fs.Root, strconv.Itoa(pid), name)
}

// Stat reads /proc/<pid>/stat.
func (fs FS) Stat(pid int) (Stat, error) {
	b, err := readBounded(fs.file(pid, "stat"), maxStatSize)
	if err != nil {
		return Stat{}, err
	}
	s, err := ParseStat(b)
	if err != nil {
		return Stat{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	return s, nil
}

// ParseStat parses the contents of a /proc/<pid>/stat file. The command name
// (field 2) is in parentheses and may itself contain spaces and
// parentheses, so fields are counted after the last ')'.
func ParseStat(b []byte) (Stat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || bytes.IndexByte(b, '(') < 0 || bytes.IndexByte(b, '(') > i {
		return Stat{}, fmt.Errorf("%w: stat without (comm)", ErrMalformed)
	}
	// Fields 3.. : state ppid pgrp session tty_nr tpgid flags minflt
	// cminflt majflt cmajflt utime stime cutime cstime priority nice
	// num_threads itrealvalue starttime
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return Stat{}, fmt.Errorf("%w: stat has %d fields after comm, want >= 20", ErrMalformed, len(f))
	}
	if len(f[0]) != 1 {
		return Stat{}, fmt.Errorf("%w: state %q", ErrMalformed, f[0])
	}
	ppid, err := strconv.Atoi(f[1])
	if err != nil || ppid < 0 {
		return Stat{}, fmt.Errorf("%w: ppid %q", ErrMalformed, f[1])
	}
	st, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return Stat{}, fmt.Errorf("%w: starttime %q", ErrMalformed, f[19])
	}
	return Stat{State: f[0][0], PPID: ppid, StartTime: st}, nil
}

// PidNS returns the inode of the pid namespace of pid.
func (fs FS) PidNS(pid int) (uint64, error) {
	l, err := os.Readlink(fs.file(pid, "ns/pid"))
	if err != nil {
		return 0, err
	}
	return ParseNSLink(l, "pid")
}

// ParseNSLink parses a namespace link such as "pid:[4026531836]".
func ParseNSLink(l, kind string) (uint64, error) {
	rest, ok := strings.CutPrefix(l, kind+":[")
	if !ok || !strings.HasSuffix(rest, "]") {
		return 0, fmt.Errorf("%w: namespace link %q", ErrMalformed, l)
	}
	v, err := strconv.ParseUint(strings.TrimSuffix(rest, "]"), 10, 64)
	if err != nil || v == 0 {
		return 0, fmt.Errorf("%w: namespace link %q", ErrMalformed, l)
	}
	return v, nil
}

// maxCgroupSize bounds what is read of a cgroup file.
const maxCgroupSize = 64 << 10

// Cgroups returns the cgroup paths of pid, one per hierarchy (a single one
// on a cgroup v2 host), cleaned and without duplicates.
func (fs FS) Cgroups(pid int) ([]string, error) {
	b, err := readBounded(fs.file(pid, "cgroup"), maxCgroupSize)
	if err != nil {
		return nil, err
	}
	return ParseCgroups(b)
}

// ParseCgroups parses /proc/<pid>/cgroup: lines "id:controllers:path".
func ParseCgroups(b []byte) ([]string, error) {
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if line == "" {
			continue
		}
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || !strings.HasPrefix(parts[2], "/") {
			return nil, fmt.Errorf("%w: cgroup line %q", ErrMalformed, line)
		}
		p := path.Clean(parts[2])
		dup := false
		for _, o := range out {
			dup = dup || o == p
		}
		if !dup {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: empty cgroup file", ErrMalformed)
	}
	return out, nil
}

// Under reports whether cgroup path p is base or below it. The root cgroup
// "/" contains everything and is never a base.
func Under(p, base string) bool {
	if base == "" || base == "/" {
		return false
	}
	return p == base || strings.HasPrefix(p, base+"/")
}

// readBounded reads at most n bytes of a /proc file with plain system
// calls: os.Open would also try to register the file with the runtime's
// poller (three more calls per file, and the attach path reads a dozen).
func readBounded(name string, n int64) ([]byte, error) {
	fd, err := retryEINTR(func() (int, error) { return unix.Open(name, unix.O_RDONLY|unix.O_CLOEXEC, 0) })
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	defer func() { _ = unix.Close(fd) }()
	buf := make([]byte, 0, min(n, 4096))
	for int64(len(buf)) < n {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		m, err := retryEINTR(func() (int, error) { return unix.Read(fd, buf[len(buf):min(int64(cap(buf)), n)]) })
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: name, Err: err}
		}
		if m == 0 {
			break
		}
		buf = buf[:len(buf)+m]
	}
	return buf, nil
}

func retryEINTR(f func() (int, error)) (int, error) {
	for {
		n, err := f()
		if !errors.Is(err, unix.EINTR) {
			return n, err
		}
	}
}
