package fakecuda

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// KernelRun is a stretch of device time in which one kernel ran, on the
// device's own timeline (CLOCK_MONOTONIC ns): [To − Dur, To). A kernel
// preempted in the timer model runs in several.
type KernelRun struct {
	From, To int64
	Pid      int // the process's pid in its own pid namespace
}

// KernelLog follows one device's record of kernel runs from one
// `fakecuda-ctl kernels` process, until Stop.
type KernelLog struct {
	cmd  *exec.Cmd
	From int64         // every run that ends after it is in the log (CLOCK_MONOTONIC ns)
	done chan struct{} // closed when the reader has seen the end of the output

	mu     sync.Mutex
	runs   []KernelRun
	lost   uint64
	err    error
	stderr strings.Builder
}

// FollowKernels starts following device dev's kernel runs in stateDir
// with the given fakecuda-ctl binary, reading the record every interval
// (at least 100 µs; it keeps the last 32,768 runs, so read well within
// that many). It returns once the follower has started: every run that
// ends after the log's From is in it.
func FollowKernels(ctl, stateDir string, dev int, every time.Duration) (*KernelLog, error) {
	us := every.Microseconds()
	if us < 100 {
		return nil, fmt.Errorf("fakecuda: kernels interval %v: want at least 100µs", every)
	}
	l := &KernelLog{done: make(chan struct{})}
	l.cmd = exec.Command(ctl, "kernels", strconv.Itoa(dev), strconv.FormatInt(us, 10)) //nolint:gosec // the caller names its own build
	l.cmd.Env = append(os.Environ(), "FAKECUDA_STATE_DIR="+stateDir)
	l.cmd.Stderr = &l.stderr
	out, err := l.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := l.cmd.Start(); err != nil {
		return nil, fmt.Errorf("fakecuda: %s kernels: %w", ctl, err)
	}
	br := bufio.NewReader(out)
	first, err := br.ReadString('\n')
	var from int64
	if err == nil {
		_, err = fmt.Sscanf(first, "from %d\n", &from)
	}
	if err != nil {
		_ = l.cmd.Process.Kill()
		_ = l.cmd.Wait()
		return nil, fmt.Errorf("fakecuda: %s kernels %d: %w: %s", ctl, dev, err, strings.TrimSpace(l.stderr.String()))
	}
	l.From = from
	go l.read(br)
	return l, nil
}

func (l *KernelLog) read(out io.Reader) {
	defer close(l.done)
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line := sc.Text()
		var (
			r   KernelRun
			dur int64
			n   uint64
			err error
		)
		if strings.HasPrefix(line, "lost ") {
			_, err = fmt.Sscanf(line, "lost %d", &n)
		} else {
			_, err = fmt.Sscanf(line, "%d %d %d", &r.To, &dur, &r.Pid)
			r.From = r.To - dur
		}
		l.mu.Lock()
		switch {
		case err != nil && l.err == nil:
			l.err = fmt.Errorf("fakecuda: kernels output %q: %w", line, err)
		case err != nil:
		case n > 0:
			l.lost += n
		default:
			l.runs = append(l.runs, r)
		}
		l.mu.Unlock()
	}
	if err := sc.Err(); err != nil {
		l.mu.Lock()
		if l.err == nil {
			l.err = fmt.Errorf("fakecuda: read kernels output: %w", err)
		}
		l.mu.Unlock()
	}
}

// Stop ends the log after one last read of the record (every run that
// ended before Stop was called is in it) and returns the runs in the order
// the device recorded them, with an error where the follower failed or
// fell so far behind that the record wrapped (runs are missing).
func (l *KernelLog) Stop() ([]KernelRun, error) {
	var early error
	select {
	case <-l.done:
		early = errors.New("fakecuda: kernels ended before it was stopped")
	default:
		_ = l.cmd.Process.Signal(syscall.SIGTERM)
	}
	t := time.AfterFunc(10*time.Second, func() { _ = l.cmd.Process.Kill() })
	<-l.done
	_ = l.cmd.Wait()
	t.Stop()
	l.mu.Lock()
	defer l.mu.Unlock()
	err := l.err
	switch {
	case err != nil:
	case early != nil:
		err = fmt.Errorf("%w: %s", early, strings.TrimSpace(l.stderr.String()))
	case l.lost > 0:
		err = fmt.Errorf("fakecuda: %d kernel runs lost: the follower read the record too seldom", l.lost)
	}
	return l.runs, err
}

// Timeline is kernel runs sorted by start, for the time a set of processes'
// kernels ran inside intervals.
type Timeline struct {
	runs []KernelRun // sorted by From
	// maxLen is the longest run: a run overlapping [from, to) starts
	// after from − maxLen.
	maxLen int64
}

// NewTimeline returns the runs of the processes for which keep says yes.
func NewTimeline(runs []KernelRun, keep func(pid int) bool) *Timeline {
	t := &Timeline{}
	for _, r := range runs {
		if keep(r.Pid) {
			t.runs = append(t.runs, r)
			t.maxLen = max(t.maxLen, r.To-r.From)
		}
	}
	sort.Slice(t.runs, func(i, j int) bool { return t.runs[i].From < t.runs[j].From })
	return t
}

// Within is the device time (ns) the timeline's kernels ran inside
// [from, to).
func (t *Timeline) Within(from, to int64) int64 {
	i := sort.Search(len(t.runs), func(i int) bool { return t.runs[i].From >= from-t.maxLen })
	var sum int64
	for ; i < len(t.runs) && t.runs[i].From < to; i++ {
		a, b := max(t.runs[i].From, from), min(t.runs[i].To, to)
		if b > a {
			sum += b - a
		}
	}
	return sum
}

// LastEnd is the latest end of the timeline's runs that start at or after
// since and end at or before until (0 if there is none).
func (t *Timeline) LastEnd(since, until int64) int64 {
	var last int64
	i := sort.Search(len(t.runs), func(i int) bool { return t.runs[i].From >= since })
	for ; i < len(t.runs) && t.runs[i].From < until; i++ {
		if t.runs[i].To <= until {
			last = max(last, t.runs[i].To)
		}
	}
	return last
}
