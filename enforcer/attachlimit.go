package enforcer

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

// Budgets of the attach server, per key: an instance, or for a caller that
// belongs to none, its pid namespace or cgroup (DESIGN.md, "One tenant
// cannot deny service to another"). A connection is counted against its
// key from the accept on; what one key holds never delays another's.
const (
	// attachActivePerKey is how many of a key's connections are served at
	// once. A silent client holds one for at most the request deadline.
	attachActivePerKey = 4
	// attachPendingPerKey is how many more wait, in order, for one of
	// those (a container that starts many CUDA processes at once); beyond
	// it a connection is refused at once.
	attachPendingPerKey = 128
	// attachMaxKeys bounds the keys tracked at once (instances count
	// against it too; max_instances is far below it); a connection of a
	// new key beyond it is refused.
	attachMaxKeys = 1024
	// attachLogEvery is the least interval between two log lines about
	// one key's refused connections.
	attachLogEvery = 10 * time.Second
)

// attachKey names whose budget a connection counts against.
type attachKey string

// unidentifiedKey is the budget of callers /proc says nothing of (exited,
// or hidden from the enforcer).
const unidentifiedKey attachKey = "unidentified"

// keyOf is the budget of a caller: its instance, else its pid namespace
// (when it is not the enforcer's), else its deepest cgroup.
func keyOf(in *instance, p peerInfo) attachKey {
	switch {
	case in != nil:
		return attachKey("instance " + in.name)
	case p.pidNS != 0:
		return attachKey(fmt.Sprintf("pid namespace %d", p.pidNS))
	}
	cg := ""
	for _, c := range p.cgroups {
		if len(c) > len(cg) {
			cg = c
		}
	}
	return attachKey("cgroup " + cg)
}

// attachLimiter runs each key's connections at most attachActivePerKey at
// a time, queues attachPendingPerKey more and refuses the rest.
type attachLimiter struct {
	log   *slog.Logger
	serve func(*attachConn)
	mu    sync.Mutex
	keys  map[attachKey]*attachBudget
	// logged is when each key's refusals were last logged, and how many
	// were refused since (entries older than attachLogEvery are dropped).
	logged map[attachKey]*attachLog
}

type attachBudget struct {
	active  int
	pending []*attachConn
}

type attachLog struct {
	at      time.Time
	refused int
}

func newAttachLimiter(log *slog.Logger, serve func(*attachConn)) *attachLimiter {
	return &attachLimiter{log: log, serve: serve, keys: map[attachKey]*attachBudget{}, logged: map[attachKey]*attachLog{}}
}

// enter serves c now, queues it, or refuses it: then ok is false and msg
// is the refusal's message.
func (l *attachLimiter) enter(c *attachConn) (msg string, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.keys[c.key]
	if b == nil {
		if len(l.keys) >= attachMaxKeys {
			return "mgpu: the enforcer is serving too many callers; retry", false
		}
		b = &attachBudget{}
		l.keys[c.key] = b
	}
	switch {
	case b.active < attachActivePerKey:
		b.active++
		go l.run(c)
		return "", true
	case len(b.pending) < attachPendingPerKey:
		b.pending = append(b.pending, c)
		return "", true
	}
	l.noteRefusedLocked(c.key, b)
	return fmt.Sprintf("mgpu: %s has %d attach connections open, the most it may; close some and retry", c.key, attachActivePerKey+attachPendingPerKey), false
}

// noteRefusedLocked logs a key's refused connections.
func (l *attachLimiter) noteRefusedLocked(k attachKey, b *attachBudget) {
	l.logRefusedLocked(k, "attach connections over their budget refused", "active", b.active, "pending", len(b.pending))
}

// logRefused logs msg for a caller at most once every attachLogEvery, with
// how many times it happened since the last line.
func (l *attachLimiter) logRefused(k attachKey, msg string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.logRefusedLocked(k, msg, args...)
}

func (l *attachLimiter) logRefusedLocked(k attachKey, msg string, args ...any) {
	now := time.Now()
	g := l.logged[k]
	if g != nil && now.Sub(g.at) < attachLogEvery {
		g.refused++
		return
	}
	for old, o := range l.logged {
		if now.Sub(o.at) >= attachLogEvery {
			delete(l.logged, old)
		}
	}
	refused := 1
	if g != nil {
		refused += g.refused
	}
	l.log.Warn(msg, append([]any{"caller", string(k), "refused", refused}, args...)...)
	l.logged[k] = &attachLog{at: now}
}

// run serves c, then the key's next pending connection, until none waits.
func (l *attachLimiter) run(c *attachConn) {
	for c != nil {
		l.serve(c)
		l.mu.Lock()
		b := l.keys[c.key]
		var next *attachConn
		if len(b.pending) > 0 {
			next = b.pending[0]
			b.pending[0] = nil
			b.pending = b.pending[1:]
		} else {
			b.active--
			if b.active == 0 {
				delete(l.keys, c.key)
			}
		}
		l.mu.Unlock()
		c = next
	}
}

// keyCache remembers the budget of a pid while the process it named when
// it was looked up lives (a pidfd of it polls quiet), for at most
// keyCacheTTL: a caller that floods the socket costs the accept loop a few
// system calls a connection, not a walk through /proc. Only the accept
// loop uses it.
type keyCache struct {
	m map[int]keyEntry
}

type keyEntry struct {
	key   attachKey
	pidfd int
	at    time.Time
}

const (
	keyCacheTTL  = time.Second // instances come and go: a budget is looked up again after it
	keyCacheSize = 256
)

func newKeyCache() *keyCache { return &keyCache{m: map[int]keyEntry{}} }

func (k *keyCache) get(pid int) (attachKey, bool) {
	e, ok := k.m[pid]
	if !ok {
		return "", false
	}
	if time.Since(e.at) < keyCacheTTL && !procfs.PidfdExited(e.pidfd) {
		return e.key, true
	}
	k.drop(pid)
	return "", false
}

// put takes pidfd (a pidfd of the process pid named when key was found).
func (k *keyCache) put(pid int, key attachKey, pidfd int) {
	if len(k.m) >= keyCacheSize {
		for p, e := range k.m {
			if time.Since(e.at) >= keyCacheTTL || procfs.PidfdExited(e.pidfd) {
				k.drop(p)
			}
		}
	}
	if _, ok := k.m[pid]; ok || len(k.m) >= keyCacheSize {
		_ = unix.Close(pidfd)
		return
	}
	k.m[pid] = keyEntry{key: key, pidfd: pidfd, at: time.Now()}
}

func (k *keyCache) drop(pid int) {
	_ = unix.Close(k.m[pid].pidfd)
	delete(k.m, pid)
}

func (k *keyCache) close() {
	for p := range k.m {
		k.drop(p)
	}
}
