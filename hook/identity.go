package hook

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Identity is how the enforcer recognises a container's processes: its init
// process (pid and start time, so that a reused pid is not mistaken for
// it), its pid namespace and its cgroup.
type Identity struct {
	// Pid is the container's init process, as the host sees it.
	Pid int
	// StartTime is the init process's start time in clock ticks after
	// boot (field 22 of /proc/<pid>/stat).
	StartTime uint64
	// PidNS is the inode of the init process's pid namespace
	// (/proc/<pid>/ns/pid).
	PidNS uint64
	// HostPidNS reports that the container shares the pid namespace of the
	// hook (e.g. --pid=host), so PidNS identifies nothing about it and the
	// enforcer must rely on the cgroup.
	HostPidNS bool
	// Cgroup is the init process's cgroup path: the cgroup v2 path, or on a
	// cgroup v1-only host the path in the first of the memory, cpu, pids or
	// name=systemd hierarchies (a container is in the same path in all).
	Cgroup string
}

// Proc reads process information from a procfs mount.
type Proc struct {
	// Root is the procfs mount, normally "/proc".
	Root string
}

// HostProc is the host's /proc.
var HostProc = Proc{Root: "/proc"}

// ErrProcessGone is returned (wrapped) when the process does not exist or
// was replaced by another one with the same pid while it was read.
var ErrProcessGone = errors.New("process is gone")

// Identity reads the identity of process pid. It reads the start time
// before and after the namespace and cgroup, so that a pid reused meanwhile
// is detected rather than attributed.
func (p Proc) Identity(pid int) (Identity, error) {
	if pid <= 0 {
		return Identity{}, fmt.Errorf("container init pid %d is not a process", pid)
	}
	id := Identity{Pid: pid}
	dir := filepath.Join(p.Root, strconv.Itoa(pid))
	start, err := p.startTime(dir)
	if err != nil {
		return Identity{}, err
	}
	id.StartTime = start
	if id.PidNS, err = nsInode(filepath.Join(dir, "ns", "pid")); err != nil {
		return Identity{}, fmt.Errorf("container init %d: %w", pid, err)
	}
	if self, err := nsInode(filepath.Join(p.Root, "self", "ns", "pid")); err == nil && self == id.PidNS {
		id.HostPidNS = true
	}
	data, err := os.ReadFile(filepath.Join(dir, "cgroup"))
	if err != nil {
		return Identity{}, procErr(pid, err)
	}
	if id.Cgroup, err = ParseCgroup(data); err != nil {
		return Identity{}, fmt.Errorf("container init %d: /proc/%d/cgroup: %w", pid, pid, err)
	}
	again, err := p.startTime(dir)
	if err != nil {
		return Identity{}, err
	}
	if again != start {
		return Identity{}, fmt.Errorf("container init %d: %w (pid reused while it was read)", pid, ErrProcessGone)
	}
	return id, nil
}

func (p Proc) startTime(dir string) (uint64, error) {
	pid, _ := strconv.Atoi(filepath.Base(dir))
	data, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return 0, procErr(pid, err)
	}
	state, st, err := ParseStat(data)
	if err != nil {
		return 0, fmt.Errorf("container init %d: /proc/%d/stat: %w", pid, pid, err)
	}
	if state == 'Z' || state == 'X' {
		return 0, fmt.Errorf("container init %d: %w (it has exited)", pid, ErrProcessGone)
	}
	return st, nil
}

// Alive reports whether process pid exists, has not exited, and started at
// startTime (so it is the same process, not a reuse of its pid).
func (p Proc) Alive(pid int, startTime uint64) bool {
	if pid <= 0 {
		return false
	}
	st, err := p.startTime(filepath.Join(p.Root, strconv.Itoa(pid)))
	return err == nil && st == startTime
}

func procErr(pid int, err error) error {
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("container init %d: %w", pid, ErrProcessGone)
	}
	return fmt.Errorf("container init %d: %w", pid, err)
}

func nsInode(path string) (uint64, error) {
	l, err := os.Readlink(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, ErrProcessGone
		}
		return 0, fmt.Errorf("pid namespace: %w", err)
	}
	return ParseNSLink(l)
}

// ParseNSLink parses a pid namespace link such as "pid:[4026531836]".
func ParseNSLink(l string) (uint64, error) {
	rest, ok := strings.CutPrefix(l, "pid:[")
	if !ok || !strings.HasSuffix(rest, "]") {
		return 0, fmt.Errorf("pid namespace link %q is not pid:[inode]", l)
	}
	v, err := strconv.ParseUint(strings.TrimSuffix(rest, "]"), 10, 64)
	if err != nil || v == 0 {
		return 0, fmt.Errorf("pid namespace link %q is not pid:[inode]", l)
	}
	return v, nil
}

// ParseStat returns fields 3 (state) and 22 (starttime) of a
// /proc/<pid>/stat line. The command name (field 2) is in parentheses and
// may itself hold spaces and parentheses, so fields are counted after the
// last ')'.
func ParseStat(data []byte) (state byte, startTime uint64, err error) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 || bytes.IndexByte(data, '(') < 0 || bytes.IndexByte(data, '(') > i {
		return 0, 0, errors.New("no command name in parentheses")
	}
	// After ")": field 3 (state) onwards; starttime is field 22, the 20th.
	fields := strings.Fields(string(data[i+1:]))
	const idx = 22 - 3
	if len(fields) <= idx {
		return 0, 0, fmt.Errorf("%d fields after the command name, want at least %d", len(fields), idx+1)
	}
	if len(fields[0]) != 1 || !isLetter(fields[0][0]) {
		return 0, 0, fmt.Errorf("state %q is not one letter", fields[0])
	}
	v, err := strconv.ParseUint(fields[idx], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("starttime %q is not a number", fields[idx])
	}
	return fields[0][0], v, nil
}

// v1Preference orders the cgroup v1 hierarchies ParseCgroup takes the path
// from when there is no unified (v2) hierarchy.
var v1Preference = []string{"memory", "cpu", "pids", "name=systemd"}

// ParseCgroup returns the cgroup path of a /proc/<pid>/cgroup file: the
// cgroup v2 entry ("0::/path") when there is one (pure v2 or hybrid
// hosts), otherwise the path of the first hierarchy of v1Preference the
// process is in, otherwise the first v1 entry's path.
func ParseCgroup(data []byte) (string, error) {
	var v2 string
	haveV2 := false
	v1 := map[string]string{}
	first := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" {
			continue
		}
		hid, rest, ok := strings.Cut(line, ":")
		if !ok {
			return "", fmt.Errorf("line %d: %q is not hierarchy:controllers:path", n, line)
		}
		ctrls, path, ok := strings.Cut(rest, ":")
		if !ok {
			return "", fmt.Errorf("line %d: %q is not hierarchy:controllers:path", n, line)
		}
		if _, err := strconv.ParseUint(hid, 10, 32); err != nil {
			return "", fmt.Errorf("line %d: hierarchy id %q is not a number", n, hid)
		}
		if !strings.HasPrefix(path, "/") {
			return "", fmt.Errorf("line %d: path %q is not absolute", n, path)
		}
		if hid == "0" && ctrls == "" {
			v2, haveV2 = path, true
			continue
		}
		if first == "" {
			first = path
		}
		for _, c := range strings.Split(ctrls, ",") {
			if _, dup := v1[c]; !dup {
				v1[c] = path
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if haveV2 {
		return v2, nil
	}
	for _, c := range v1Preference {
		if p, ok := v1[c]; ok {
			return p, nil
		}
	}
	if first != "" {
		return first, nil
	}
	return "", errors.New("no cgroup entries")
}

func isLetter(c byte) bool { return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' }
