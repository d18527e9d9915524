package enforcer

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// An attached process gets its instance's wake socket; what it sends on it
// wakes the loop's wait; the socket goes with the instance; a process that
// is not attached is refused one.
func TestWakeSocket(t *testing.T) {
	env := newEnv(t, nil)
	// The attach server without the loop, which would write the wake
	// word at its ticks.
	e, err := New(env.cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if e.epfd < 0 {
		t.Skip("no epoll set")
	}
	sctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { e.serveAttach(sctx); close(served) }()
	defer func() { cancel(); _ = e.client.Close(); <-served }()
	sock := api.ClientSocket(env.runDir())
	if _, err := attach.Wake(sock, 5*time.Second); err == nil {
		t.Fatal("a process of no instance got a wake socket")
	}
	out, err := e.Create(tree(os.Getpid(), 50, 100))
	if err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	mapAttach(t, res)
	w, err := attach.Wake(sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Close() }()
	w2, err := attach.Wake(sock, 5*time.Second) // the same pair again
	if err != nil {
		t.Fatal(err)
	}
	_ = w2.Close()

	// The loop does not run: this wait is the only one on the epoll set.
	// Waits shorter than rawWaitMax block the thread, longer ones park on
	// the poller: both are checked.
	lw := e.newLoopWait()
	if lw == nil {
		t.Fatal("no loop wait")
	}
	defer e.closeLoopWait(lw)
	wait := func(d time.Duration) (bool, time.Duration) {
		t0 := monotonic()
		woken := e.waitUntil(lw, t0+d, t0)
		return woken, monotonic() - t0
	}
	send := func() {
		t.Helper()
		if _, err := unix.SendmsgN(int(w.Fd()), []byte{1}, nil, nil, unix.MSG_DONTWAIT); err != nil {
			t.Fatal(err)
		}
	}
	drain := func() {
		e.mu.Lock()
		e.drainWakesLocked()
		e.mu.Unlock()
	}
	for _, d := range []time.Duration{rawWaitMax / 2, 20 * time.Millisecond} {
		if woken, took := wait(d); woken || took < d {
			t.Fatalf("nothing sent: woken %v after %v, want a %v wait", woken, took, d)
		}
		// Its wake word is 0: nobody asked it, and it cannot wake the loop.
		send()
		if woken, took := wait(d); woken || took < d {
			t.Fatalf("woken by an instance whose wake word is 0 (after %v of %v)", took, d)
		}
		drain()
	}
	e.mu.Lock()
	e.setWakeLocked(e.list[0], region.WakeBusy)
	e.mu.Unlock()
	for _, d := range []time.Duration{rawWaitMax - time.Microsecond, 10 * time.Second} {
		send() // before the wait
		// woken is the datagram's doing (a wait that runs out returns
		// false); how soon is checked on the long wait only: a bound of
		// 1 ms measures the host's scheduling under load (go test -race of
		// every package at once: 1.75 ms once).
		if woken, took := wait(d); !woken || (d > time.Second && took > 5*time.Second) {
			t.Fatalf("asked to, a datagram sent: woken %v after %v of %v", woken, took, d)
		}
		drain()
		if woken, took := wait(rawWaitMax / 2); woken || took < rawWaitMax/2 {
			t.Fatalf("woken again after the datagram was discarded (after %v)", took)
		}
		if woken, _ := wait(5 * time.Millisecond); woken {
			t.Fatal("woken again after the datagram was discarded")
		}
	}
	// A datagram that arrives while the loop is parked wakes it (should the
	// send come first, this is the case above).
	sent := make(chan error, 1)
	go func() {
		time.Sleep(5 * time.Millisecond)
		_, err := unix.SendmsgN(int(w.Fd()), []byte{1}, nil, nil, unix.MSG_DONTWAIT)
		sent <- err
	}()
	woken, took := wait(10 * time.Second)
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	if !woken || took > 5*time.Second {
		t.Fatalf("a datagram sent during the wait: woken %v after %v", woken, took)
	}
	drain()

	if _, err := e.Destroy(out.Instance.Name); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.SendmsgN(int(w.Fd()), []byte{1}, nil, nil, unix.MSG_DONTWAIT); !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("sent on a released instance's wake socket: %v, want ECONNREFUSED", err)
	}
}

// The tick writes what the processes act on: an offline instance fills
// the device once the online holder has been quiet for the fill grace (one
// kernel at a time, MGPU_GRANT_ONE, under online_offline_switch = 2), the
// online one is then asked to wake the loop when it gets work, and is asked
// to report going idle while the offline one waits.
func TestFillWords(t *testing.T) {
	for _, tc := range []struct {
		sw   string
		fill uint32
	}{{"1", region.GrantAll}, {"2", region.GrantOne}} {
		t.Run("switch "+tc.sw, func(t *testing.T) { testFillWords(t, tc.sw, tc.fill) })
	}
}

func testFillWords(t *testing.T, sw string, fill uint32) {
	// guaranteed-burst-share: the online instance enters as soon as it
	// waits (under fixed-share it first banks its entry credit, and the
	// offline one fills meanwhile).
	burst, switchOn := withPolicy("guaranteed-burst-share"), withOnlineOffline(sw)
	env := newEnv(t, func(s string) string { return switchOn(burst(s)) })
	e, err := New(env.cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.Create(classTree(os.Getpid(), 50, 100, "online")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Create(classTree(os.Getppid(), 100, 100, "offline")); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	on, off := e.list[0], e.list[1]
	po, pf := claim(t, on, 0, os.Getpid()), claim(t, off, 0, os.Getppid())
	lo, lf := on.reg.L(), off.reg.L()
	e.mu.Unlock()

	now := time.Second
	tick := func(what string) time.Duration {
		t.Helper()
		at, active := e.tickAt(now)
		if !active {
			t.Fatalf("%s: not active", what)
		}
		return at
	}
	check := func(what string, onGrant, offGrant, onWake uint32) {
		t.Helper()
		if g, f, w := lo.Grant.Load(), lf.Grant.Load(), lo.Wake.Load(); g != onGrant || f != offGrant || w != onWake {
			t.Fatalf("%s: online grant %d, offline grant %d, online wake %d; want %d, %d, %d", what, g, f, w, onGrant, offGrant, onWake)
		}
	}
	// The online instance works; the offline one waits.
	po.Waiting.Store(1)
	pf.Waiting.Store(1)
	tick("online waits")
	now += time.Millisecond
	po.Waiting.Store(0)
	po.QueuedNs.Store(500_000)
	po.Launches.Store(10)
	tick("online works")
	check("online works", region.GrantAll, 0, region.WakeIdle)

	// Its queue empties: the offline one waits out the fill grace.
	now += time.Millisecond
	idle := now - arbiter.DefaultFillGrace/2
	po.IdleNs.Store(uint64(idle)) //nolint:gosec // positive
	po.QueuedNs.Store(0)
	at := tick("online quiet")
	check("online quiet", region.GrantAll, 0, 0)
	if want := idle + arbiter.DefaultFillGrace; at > want+time.Microsecond || at < now {
		t.Fatalf("online quiet since %v: next tick at %v, want the end of the fill grace %v", idle, at, want)
	}
	now = at
	tick("fill grace over")
	check("fill grace over", region.GrantAll, fill, region.WakeBusy)

	// The online holder gets work: the fill ends at once, its grant stays.
	now += 10 * time.Microsecond
	po.QueuedNs.Store(200_000)
	po.Launches.Store(11)
	tick("online works again")
	check("online works again", region.GrantAll, 0, region.WakeIdle)
}

// A process reads its wake word after it stores queued_ns or waiting, and
// the tick writes the word before it looks at them again: a change that
// fell between the tick's read of the slots and its write of the word (and
// so was sent to nobody) is seen there, and the loop ticks again at once
// rather than at its next decision, up to maxActiveTick later, while the
// offline instance filled beside an online one at work.
func TestMissedWake(t *testing.T) {
	env := newEnv(t, withOnlineOffline("2"))
	e, err := New(env.cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.Create(classTree(os.Getpid(), 50, 100, "online")); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	on := e.list[0]
	p := claim(t, on, 0, os.Getpid())
	for _, tc := range []struct {
		what          string
		old, word     uint32
		readQueued    uint64 // what the tick read
		readWaits     bool
		queued, waits uint64 // what the slots hold when the word is written
		want          bool
	}{
		{"asked to report work, it got work since the read", 0, region.WakeBusy, 0, false, 200_000, 0, true},
		{"asked to report work, a thread started waiting since", 0, region.WakeBusy, 0, false, 0, 1, true},
		{"asked to report work, it has none", 0, region.WakeBusy, 0, false, 0, 0, false},
		{"asked to report work, it had it when read (a revoked tail)", 0, region.WakeBusy, 200_000, false, 200_000, 0, false},
		{"asked to report work, it waited when read", 0, region.WakeBusy, 0, true, 0, 1, false},
		{"asked to report going quiet, it went quiet since the read", 0, region.WakeIdle, 200_000, false, 0, 0, true},
		{"asked to report going quiet, it was quiet when read", 0, region.WakeIdle, 0, false, 0, 0, false},
		{"asked to report going quiet, it works", 0, region.WakeIdle, 200_000, false, 200_000, 0, false},
		{"already asked", region.WakeBusy, region.WakeBusy, 0, false, 200_000, 0, false},
		{"asked nothing", region.WakeBusy, 0, 0, false, 200_000, 0, false},
	} {
		on.readQueued, on.readWaiting = tc.readQueued, tc.readWaits
		p.QueuedNs.Store(tc.queued)
		p.Waiting.Store(uint32(tc.waits)) //nolint:gosec // small
		if got := e.missedWakeLocked(on, tc.old, tc.word); got != tc.want {
			t.Errorf("%s: missed %v, want %v", tc.what, got, tc.want)
		}
	}
}
