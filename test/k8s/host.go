package k8s

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// Host paths a kubelet uses whatever its flags say. The cluster takes
// KubeletRootDir only when it is absent (or left by an earlier cluster,
// which marks it); the others it removes on teardown only when they were
// absent before.
const (
	// KubeletRootDir is the kubelet's --root-dir: the device-plugin
	// socket directory is fixed beneath it (/var/lib/kubelet/device-plugins).
	KubeletRootDir = "/var/lib/kubelet"
	// containerLogLinks is where the kubelet links container logs.
	containerLogLinks = "/var/log/containers"
	// cniCache is where libcni caches results.
	cniCache = "/var/lib/cni"
	// marker names a directory as the cluster's own.
	marker = ".mgpu-k8s"
	// lockFile serialises clusters across test binaries: they share the
	// host paths above.
	lockFile = "/run/mgpu-k8s.lock"
)

// Sysctls the kubelet sets on start (its kernel tunables); the cluster
// puts back what was there.
var kubeletSysctls = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
	"kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward"}

// hostState is what the host had before the cluster, to put back.
type hostState struct {
	created  map[string]bool   // host directories the cluster made
	sysctls  map[string]string // /proc/sys paths -> value before
	cgroups  []string          // <cgroup mount>/kubepods that did not exist before
	lockFile *os.File
}

// lock takes the host-wide cluster lock, waiting up to timeout.
func lock(timeout time.Duration) (*os.File, error) {
	f, err := os.OpenFile(lockFile, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	err = harness.WaitFor(timeout, func() error {
		return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	})
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("k8s: another cluster holds %s: %w", lockFile, err)
	}
	return f, nil
}

// claimHost records the host's state and takes the kubelet's host
// directories, cleaning what an earlier (killed) cluster left there.
func claimHost(h *hostState) error {
	h.created = map[string]bool{}
	h.sysctls = map[string]string{}
	_, err := os.Stat(KubeletRootDir)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return err
	default:
		if _, err := os.Stat(filepath.Join(KubeletRootDir, marker)); err != nil {
			return fmt.Errorf("k8s: %s exists and is not a test cluster's (no %s in it); remove it or run elsewhere", KubeletRootDir, marker)
		}
		// Left by a cluster whose test binary was killed.
		unmountUnder(KubeletRootDir)
		if err := os.RemoveAll(KubeletRootDir); err != nil {
			return fmt.Errorf("k8s: remove the stale %s: %w", KubeletRootDir, err)
		}
	}
	if err := os.MkdirAll(KubeletRootDir, 0o755); err != nil { //nolint:gosec // as the kubelet makes it
		return err
	}
	if err := os.WriteFile(filepath.Join(KubeletRootDir, marker), []byte("made by mgpu test/k8s\n"), 0o644); err != nil { //nolint:gosec // a marker
		return err
	}
	h.created[KubeletRootDir] = true
	// Shared with other users of the host: removed only when absent before.
	for _, dir := range []string{containerLogLinks, cniCache} {
		if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
			h.created[dir] = true
		}
	}
	for _, s := range kubeletSysctls {
		if v, err := os.ReadFile(filepath.Join("/proc/sys", s)); err == nil {
			h.sysctls[s] = strings.TrimSpace(string(v))
		}
	}
	for _, m := range cgroupMounts() {
		p := filepath.Join(m, "kubepods")
		if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
			h.cgroups = append(h.cgroups, p)
		}
	}
	return nil
}

// releaseHost kills what is left in the kubepods cgroups, removes them and
// the kubelet's host directories, and puts the sysctls back.
func releaseHost(h *hostState) []error {
	var errs []error
	for _, cg := range h.cgroups {
		if err := removeCgroupTree(cg); err != nil {
			errs = append(errs, err)
		}
	}
	for dir := range h.created {
		unmountUnder(dir)
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, err)
		}
	}
	for s, v := range h.sysctls {
		p := filepath.Join("/proc/sys", s)
		if now, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(now)) != v {
			if err := os.WriteFile(p, []byte(v), 0o644); err != nil { //nolint:gosec // a sysctl
				errs = append(errs, fmt.Errorf("k8s: restore %s=%s: %w", s, v, err))
			}
		}
	}
	if h.lockFile != nil {
		_ = h.lockFile.Close()
		h.lockFile = nil
	}
	return errs
}

// cgroupMounts lists the mount points of the cgroup hierarchies.
func cgroupMounts() []string {
	var out []string
	for _, m := range mounts() {
		if m.fstype == "cgroup" || m.fstype == "cgroup2" {
			out = append(out, m.point)
		}
	}
	return out
}

// cgroupProcs lists the processes in the cgroup tree root.
func cgroupProcs(root string) []int {
	var pids []int
	_ = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil //nolint:nilerr // a cgroup that went away
		}
		data, err := os.ReadFile(filepath.Join(path, "cgroup.procs")) //nolint:gosec // a cgroup file
		if err != nil {
			return nil //nolint:nilerr // a cgroup that went away
		}
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// removeCgroupTree kills the processes in the tree and removes its
// cgroups, the deepest first.
func removeCgroupTree(root string) error {
	if _, err := os.Stat(root); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	err := harness.WaitFor(10*time.Second, func() error {
		pids := cgroupProcs(root)
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if len(pids) > 0 {
			return fmt.Errorf("processes %v in %s", pids, root)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("k8s: %w", err)
	}
	var dirs []string
	_ = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	return harness.WaitFor(10*time.Second, func() error {
		var left []string
		for _, d := range dirs {
			if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
				left = append(left, d)
			}
		}
		if len(left) > 0 {
			return fmt.Errorf("k8s: cgroups %v not removed", left)
		}
		return nil
	})
}

type mount struct{ point, fstype string }

// mounts is the mount table of this process, in mount order.
func mounts() []mount {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer func() { _ = f.Close() }()
	var out []mount
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent major:minor root point options [optional...] - fstype source super
		fields := strings.Fields(sc.Text())
		if len(fields) < 7 {
			continue
		}
		m := mount{point: unescapeMount(fields[4])}
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) {
				m.fstype = fields[i+1]
				break
			}
		}
		out = append(out, m)
	}
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// mountsUnder lists the mount points at or below dir, the latest first.
func mountsUnder(dir string) []string {
	var out []string
	all := mounts()
	for i := len(all) - 1; i >= 0; i-- {
		p := all[i].point
		if p == dir || strings.HasPrefix(p, dir+"/") {
			out = append(out, p)
		}
	}
	return out
}

// unmountUnder detaches every mount at or below dir.
func unmountUnder(dir string) {
	for range 3 {
		ms := mountsUnder(dir)
		if len(ms) == 0 {
			return
		}
		for _, m := range ms {
			_ = unix.Unmount(m, unix.MNT_DETACH)
		}
	}
}

// processesMatching lists "pid cmdline" of the processes whose command
// line contains one of the strings.
func processesMatching(subs ...string) []string {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []string
	self := os.Getpid()
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		data, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(data) == 0 {
			continue
		}
		cmdline := strings.ReplaceAll(strings.TrimRight(string(data), "\x00"), "\x00", " ")
		for _, s := range subs {
			if s != "" && strings.Contains(cmdline, s) {
				out = append(out, fmt.Sprintf("%d %s", pid, cmdline))
				break
			}
		}
	}
	return out
}

// killProcessesMatching SIGKILLs the processes processesMatching finds.
func killProcessesMatching(subs ...string) {
	for _, p := range processesMatching(subs...) {
		if pid, err := strconv.Atoi(strings.Fields(p)[0]); err == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// linkExists reports whether the network interface exists.
func linkExists(name string) bool {
	_, err := os.Stat(filepath.Join("/sys/class/net", name))
	return err == nil
}

// deleteLink removes a network interface (the pod bridge).
func deleteLink(name string) error {
	if !linkExists(name) {
		return nil
	}
	if out, err := exec.Command("ip", "link", "delete", name).CombinedOutput(); err != nil { //nolint:gosec // our bridge's name
		return fmt.Errorf("k8s: ip link delete %s: %w: %s", name, err, out)
	}
	return nil
}
