package backstop

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

var host = HostProcs{FS: procfs.Host}

// child starts a process that sleeps until killed.
func child(t *testing.T) (*exec.Cmd, Target) {
	t.Helper()
	if _, err := unix.PidfdOpen(os.Getpid(), 0); errors.Is(err, unix.ENOSYS) {
		t.Skip("pidfd_open needs Linux >= 5.3")
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	st, err := host.StartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	return cmd, Target{PID: cmd.Process.Pid, StartTime: st}
}

func killedBySIGKILL(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

func TestPidfdKillerKillsTheObservedProcess(t *testing.T) {
	t.Parallel()
	cmd, tgt := child(t)
	if err := NewPidfdKiller().Kill(tgt); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); !killedBySIGKILL(err) {
		t.Fatalf("child ended with %v, want SIGKILL", err)
	}
}

func TestPidfdKillerRefusesAnotherStartTime(t *testing.T) {
	t.Parallel()
	cmd, tgt := child(t)
	tgt.StartTime++ // the pid as if reused by a process started later
	if err := NewPidfdKiller().Kill(tgt); !errors.Is(err, ErrPidReused) {
		t.Fatalf("got %v, want ErrPidReused", err)
	}
	// Still running.
	if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("child: %v", err)
	}
	if st, err := host.StartTime(tgt.PID); err != nil || st != tgt.StartTime-1 {
		t.Fatalf("child start time %d, %v", st, err)
	}
}

func TestPidfdKillerExitedProcess(t *testing.T) {
	t.Parallel()
	cmd, tgt := child(t)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// A zombie (exited, not reaped) is not signalled.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := host.StartTime(tgt.PID); errors.Is(err, os.ErrProcessDone) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("child did not exit")
		}
		time.Sleep(time.Millisecond)
	}
	if err := NewPidfdKiller().Kill(tgt); !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("zombie: got %v, want os.ErrProcessDone", err)
	}
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
		t.Fatalf("child ended with %v, want SIGTERM", err)
	}
	// Reaped: gone, unless the pid was reused meanwhile (then refused).
	if err := NewPidfdKiller().Kill(tgt); !errors.Is(err, os.ErrProcessDone) && !errors.Is(err, ErrPidReused) {
		t.Fatalf("reaped: got %v", err)
	}
}

func TestPidfdKillerBadPID(t *testing.T) {
	t.Parallel()
	for _, pid := range []int{0, -1} {
		if err := NewPidfdKiller().Kill(Target{PID: pid}); err == nil {
			t.Errorf("pid %d: killed", pid)
		}
	}
}

func TestHostProcs(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	rest := " 1 1 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 1000 100 0"
	for pid, stat := range map[string]string{"1": "1 (init) S 0" + rest, "2": "2 (z) Z 1" + rest, "3": "3 (bad"} {
		if err := os.MkdirAll(filepath.Join(root, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, pid, "stat"), []byte(stat), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p := HostProcs{FS: procfs.FS{Root: root}}
	if st, err := p.StartTime(1); err != nil || st != 777 {
		t.Errorf("live: %d, %v", st, err)
	}
	for _, pid := range []int{2, 4} {
		if _, err := p.StartTime(pid); !errors.Is(err, os.ErrProcessDone) {
			t.Errorf("pid %d: %v, want os.ErrProcessDone", pid, err)
		}
	}
	if _, err := p.StartTime(3); err == nil || errors.Is(err, os.ErrProcessDone) {
		t.Errorf("malformed: %v", err)
	}
	if st, err := host.StartTime(os.Getpid()); err != nil || st == 0 {
		t.Errorf("self: %d, %v", st, err)
	}
}

// TestHostProcsRemembers checks that NewHostProcs's HostProcs reads a live
// process's start time once and then believes its pidfd, and reads again
// once the process has exited.
func TestHostProcsRemembers(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	pid := cmd.Process.Pid
	root := t.TempDir()
	dir := filepath.Join(root, strconv.Itoa(pid))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// A stat file under a fake root names the live child: what is read
	// from it shows when the file is read.
	stat := func(start int) {
		line := fmt.Sprintf("%d (sleep) S 1 1 1 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 %d 1000 100 0", pid, start)
		if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(line), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p := NewHostProcs(procfs.FS{Root: root})
	stat(500)
	if st, err := p.StartTime(pid); err != nil || st != 500 {
		t.Fatalf("first: %d, %v, want 500", st, err)
	}
	stat(600)
	if st, err := p.StartTime(pid); err != nil || st != 500 {
		t.Fatalf("while it lives: %d, %v, want the remembered 500", st, err)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if st, err := p.StartTime(pid); err != nil || st != 600 {
		t.Fatalf("after it exited: %d, %v, want 600 read again", st, err)
	}
	if _, ok := p.starts.m[pid]; ok {
		t.Fatal("the exited process is still remembered")
	}
}
