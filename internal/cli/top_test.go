package cli

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/metrics"
)

// asMainEnv makes the test binary run mgpu-cli (Main with its arguments)
// instead of the tests: TestTopTerminal runs it so in tmux. It exists only
// in the test binary.
const asMainEnv = "MGPU_CLI_TEST_AS_MAIN"

func init() {
	if os.Getenv(asMainEnv) == "1" {
		os.Exit(Main(append([]string{"mgpu-cli"}, os.Args[1:]...), os.Stdout, os.Stderr))
	}
}

func TestTopFrame(t *testing.T) {
	f := newTopFrame(fakeSample(0), fakeSample(1))
	var table, js strings.Builder
	if err := writeTopFrame(&table, f, "table", false); err != nil {
		t.Fatal(err)
	}
	if err := writeTopFrame(&js, f, "json", false); err != nil {
		t.Fatal(err)
	}
	golden(t, "top.txt", table.String())
	golden(t, "top.json", js.String())

	if f.At != "2026-12-04T20:00:01Z" || f.IntervalS != 1 || len(f.Devices) != 2 {
		t.Fatalf("frame %+v", f)
	}
	d := f.Devices[0]
	if !d.Running || d.Policy != "fixed-share" || *d.BusyPercent != 62 || d.MemoryAllocatedMiB != 12192 || d.MemoryMiB != 81920 || len(d.Instances) != 2 {
		t.Errorf("device 0 %+v", d)
	}
	in := d.Instances[0]
	if in.Namespace != "ml" || in.Pod != "trainer-7d9f8-x2x4q" || in.Container != "pytorch" || *in.SharePercent != 41 ||
		*in.ThrottledPercent != 12 || in.MemoryUsedMiB != 2049 || in.MemoryQuotaMiB != 8192 || in.Processes != 1 {
		t.Errorf("instance 0 %+v", in)
	}
	if in := d.Instances[1]; in.Pod != "" || *in.SharePercent != 20.5 || *in.ThrottledPercent != 0 || in.MemoryUsedMiB != 100 || in.who() != "9b1c7e2a5d3f" {
		t.Errorf("instance 1 %+v", in)
	}
	if d := f.Devices[1]; d.Running || !d.notRunning || d.BusyPercent != nil || d.MemoryMiB != 23028 || len(d.Instances) != 0 ||
		d.Error != "device 1: the enforcer is not running (start it: systemctl start mgpu-enforcer@1)" {
		t.Errorf("device 1 %+v", d)
	}
}

// TestTopJSONFields: the names scripts rely on, and nothing else.
func TestTopJSONFields(t *testing.T) {
	b, err := json.Marshal(newTopFrame(fakeSample(0), fakeSample(1)))
	if err != nil {
		t.Fatal(err)
	}
	var f map[string]any
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	keys := func(m any) string {
		var k []string
		for n := range m.(map[string]any) {
			k = append(k, n)
		}
		sort.Strings(k)
		return strings.Join(k, " ")
	}
	devs := f["devices"].([]any)
	for _, tc := range []struct {
		name string
		obj  any
		want string
	}{
		{"frame", f, "at devices interval_s"},
		{"device", devs[0], "busy_percent index instances memory_allocated_mib memory_mib policy running"},
		{"device not running", devs[1], "busy_percent error index instances memory_allocated_mib memory_mib policy running"},
		{"instance", devs[0].(map[string]any)["instances"].([]any)[0],
			"claim class container container_id core memory_quota_mib memory_used_mib name namespace pod processes share_percent throttled_percent"},
	} {
		if got := keys(tc.obj); got != tc.want {
			t.Errorf("%s: keys %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestTopRates: what a counter is compared with.
func TestTopRates(t *testing.T) {
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	started := at(-time.Hour)
	inst := func(name string, created time.Time) api.Instance {
		return api.Instance{Name: name, Kind: api.KindContainer, ContainerID: "c-" + name, Core: 10, MemoryMiB: 100, Created: created}
	}
	stat := func(name string, gpuNs uint64, throttled int64) api.InstanceStats {
		return api.InstanceStats{Name: name, GPUNs: gpuNs, DemandThrottledNs: throttled}
	}
	sample := func(when time.Time, e *fakeEnforcer) nodeSample {
		return sampleNode(context.Background(), fakeDevices()[:1], []metrics.Source{e}, true, func() time.Time { return when })
	}
	running := func(started time.Time, busy uint64, list []api.Instance, stats ...api.InstanceStats) *fakeEnforcer {
		return &fakeEnforcer{device: api.DeviceResponse{Policy: "fixed-share", EnforcerPID: 7, Started: started, BusyNs: busy}, list: list, stats: stats}
	}
	p := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		name       string
		prev, cur  *fakeEnforcer
		busy       *float64
		share, thr []*float64 // per instance of cur
	}{{
		name:  "same enforcer and instance",
		prev:  running(started, 1e9, []api.Instance{inst("a", started)}, stat("a", 5e9, 1e9)),
		cur:   running(started, 1.5e9, []api.Instance{inst("a", started)}, stat("a", 5.25e9, 1.1e9)),
		busy:  p(50),
		share: []*float64{p(25)}, thr: []*float64{p(10)},
	}, {
		name:  "instance created between the samples counts from zero",
		prev:  running(started, 1e9, nil),
		cur:   running(started, 1.1e9, []api.Instance{inst("a", at(500*time.Millisecond))}, stat("a", 1e8, 3e8)),
		busy:  p(10),
		share: []*float64{p(10)}, thr: []*float64{p(30)},
	}, {
		name:  "instance recreated under the same name",
		prev:  running(started, 1e9, []api.Instance{inst("a", started)}, stat("a", 9e9, 9e9)),
		cur:   running(started, 1e9, []api.Instance{inst("a", at(time.Second/2))}, stat("a", 2e8, 0)),
		busy:  p(0),
		share: []*float64{p(20)}, thr: []*float64{p(0)},
	}, {
		name:  "enforcer not running before: no rates for older things",
		prev:  &fakeEnforcer{err: errNotListening},
		cur:   running(started, 1e9, []api.Instance{inst("a", started)}, stat("a", 2e8, 0)),
		busy:  nil,
		share: []*float64{nil}, thr: []*float64{nil},
	}, {
		name:  "enforcer started between the samples",
		prev:  &fakeEnforcer{err: errNotListening},
		cur:   running(at(time.Second/4), 3e8, []api.Instance{inst("a", at(time.Second/2))}, stat("a", 2e8, 1e8)),
		busy:  p(30),
		share: []*float64{p(20)}, thr: []*float64{p(10)},
	}, {
		name:  "counter went back",
		prev:  running(started, 1e9, []api.Instance{inst("a", started)}, stat("a", 9e9, 5e8)),
		cur:   running(started, 1.2e9, []api.Instance{inst("a", started)}, stat("a", 4e8, 1e8)),
		busy:  p(20),
		share: []*float64{p(40)}, thr: []*float64{p(10)},
	}, {
		name:  "instance without statistics",
		prev:  running(started, 1e9, []api.Instance{inst("a", started)}, stat("a", 1e9, 0)),
		cur:   running(started, 1e9, []api.Instance{inst("a", started)}),
		busy:  p(0),
		share: []*float64{nil}, thr: []*float64{nil},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newTopFrame(sample(at(0), tc.prev), sample(at(time.Second), tc.cur))
			d := f.Devices[0]
			if !eqPercent(d.BusyPercent, tc.busy) {
				t.Errorf("busy %s, want %s", percent(d.BusyPercent), percent(tc.busy))
			}
			if len(d.Instances) != len(tc.share) {
				t.Fatalf("%d instances", len(d.Instances))
			}
			for i, in := range d.Instances {
				if !eqPercent(in.SharePercent, tc.share[i]) || !eqPercent(in.ThrottledPercent, tc.thr[i]) {
					t.Errorf("instance %d: share %s throttled %s, want %s and %s", i,
						percent(in.SharePercent), percent(in.ThrottledPercent), percent(tc.share[i]), percent(tc.thr[i]))
				}
			}
		})
	}
}

func eqPercent(a, b *float64) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }

func TestTopFormatting(t *testing.T) {
	p := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		p          *float64
		bar, fixed string
	}{
		{nil, "[..........]", "-"},
		{p(0), "[..........]", "0%"},
		{p(4.9), "[..........]", "5%"},
		{p(5), "[#.........]", "5%"},
		{p(41), "[####......]", "41%"},
		{p(99.6), "[##########]", "100%"},
		{p(180), "[##########]", "180%"},
	} {
		if got := shareBar(tc.p); got != tc.bar {
			t.Errorf("shareBar(%s) = %q, want %q", percent(tc.p), got, tc.bar)
		}
		if got := percent(tc.p); got != tc.fixed {
			t.Errorf("percent = %q, want %q", got, tc.fixed)
		}
	}
	for _, tc := range []struct{ b, mib uint64 }{{0, 0}, {1, 1}, {1 << 20, 1}, {1<<20 + 1, 2}, {100 << 20, 100}} {
		if got := ceilMiB(tc.b); got != tc.mib {
			t.Errorf("ceilMiB(%d) = %d, want %d", tc.b, got, tc.mib)
		}
	}
	for _, tc := range []struct {
		in   topInstance
		want string
	}{
		{topInstance{Namespace: "ns", Pod: "p", Container: "c", ContainerID: "0123456789abcdef"}, "ns/p/c"},
		{topInstance{Namespace: "ns", Pod: "p", Container: "c", Claim: "p-gpu-x7k2q"}, "ns/p/c claim p-gpu-x7k2q"},
		{topInstance{ContainerID: "0123456789abcdef"}, "0123456789ab"},
		{topInstance{ContainerID: "short"}, "short"},
		{topInstance{kind: api.KindProcessTree, pid: 42}, "pid 42"},
	} {
		if got := tc.in.who(); got != tc.want {
			t.Errorf("who() = %q, want %q", got, tc.want)
		}
	}
	if got := clip("abcdef\nxyz\n123\n", 2, 4); got != "abcd\nxyz" {
		t.Errorf("clip: %q", got)
	}
	if got := clip("äöü\n", 0, 2); got != "äö" {
		t.Errorf("clip runes: %q", got)
	}
}

// TestTopPlain: frames follow one another, a blank line apart, without
// escape codes, until the context ends; --once prints one.
func TestTopPlain(t *testing.T) {
	for _, tc := range []struct {
		name, format string
		once         bool
		frames       int
	}{
		{"table", "table", false, 3},
		{"json", "json", false, 3},
		{"once", "table", true, 1},
		{"once json", "json", true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			step := -1
			sample := func(context.Context) nodeSample {
				step++
				if step > tc.frames {
					cancel() // the plain loop checks the context after sampling
				}
				return fakeSample(step)
			}
			var b strings.Builder
			if err := runTopPlain(ctx, &b, sample, time.Millisecond, tc.once, tc.format); err != nil {
				t.Fatal(err)
			}
			out := b.String()
			if strings.Contains(out, "\x1b") {
				t.Errorf("escape codes in %q", out)
			}
			if tc.format == "json" {
				lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
				if len(lines) != tc.frames {
					t.Fatalf("%d lines, want %d:\n%s", len(lines), tc.frames, out)
				}
				for i, l := range lines {
					var f topFrame
					if err := json.Unmarshal([]byte(l), &f); err != nil || f.At != t0.Add(time.Duration(i+1)*time.Second).Format(time.RFC3339) {
						t.Errorf("line %d: %v %q", i, err, l)
					}
				}
				return
			}
			if n := strings.Count(out, "mgpu top  "); n != tc.frames {
				t.Fatalf("%d frames, want %d:\n%s", n, tc.frames, out)
			}
			for i := 1; i < tc.frames; i++ {
				if title := "\n\nmgpu top  " + t0.Add(time.Duration(i+1)*time.Second).Format(time.DateTime); !strings.Contains(out, title) {
					t.Errorf("no %q in\n%s", title, out)
				}
			}
		})
	}
}

func TestTopOnceCommand(t *testing.T) {
	useFakeDevice0(t)
	cfg := fakeNodeConfig(t)
	out, stderr, code := run(t, "--config", cfg, "top", "--once", "--interval", "10ms")
	if code != 0 || stderr != "" {
		t.Fatalf("status %d: %s", code, stderr)
	}
	if strings.Count(out, "mgpu top  ") != 1 || strings.Contains(out, "\x1b") || strings.Contains(out, "(q: quit)") ||
		!strings.Contains(out, "\nmgpu0inst0  ml/trainer-7d9f8-x2x4q/pytorch  online  50%   [..........]   0%  2049/8192    0%         1\n") ||
		!strings.Contains(out, "\n1    not running  -            -     -/23028      -\n") {
		t.Errorf("frame:\n%s", out)
	}
	out, _, code = run(t, "--config", cfg, "top", "--once", "--interval", "10ms", "-o", "json")
	var f topFrame
	if code != 0 || strings.Count(out, "\n") != 1 || json.Unmarshal([]byte(out), &f) != nil {
		t.Fatalf("status %d: %q", code, out)
	}
	if f.IntervalS < 0.01 || len(f.Devices) != 2 || len(f.Devices[0].Instances) != 2 || f.Devices[1].Running ||
		*f.Devices[0].BusyPercent != 0 || *f.Devices[0].Instances[1].SharePercent != 0 {
		t.Errorf("frame %s", out)
	}
}

func TestTopErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"zero interval", []string{"--interval", "0s"}, "--interval 0s is out of range (want more than 0 and at most 1h)"},
		{"negative interval", []string{"--interval", "-1s"}, "--interval -1s is out of range (want more than 0 and at most 1h)"},
		{"long interval", []string{"--interval", "61m"}, "--interval 1h1m0s is out of range (want more than 0 and at most 1h)"},
		{"not a duration", []string{"--interval", "abc"}, `invalid value "abc" for flag -interval: parse error`},
		{"bad output", []string{"-o", "xml"}, `unknown --output "xml" (want table or json)`},
		{"argument", []string{"gpu0"}, `top takes no arguments, got "gpu0"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr, code := run(t, append([]string{"--config", simNode, "top", "--once"}, tc.args...)...)
			if code != exitUsage || out != "" || stderr != "mgpu: "+tc.stderr+"\n" {
				t.Errorf("status %d stdout %q stderr %q, want %d and %q", code, out, stderr, exitUsage, tc.stderr)
			}
		})
	}
}

func TestReadKeys(t *testing.T) {
	quit := 0
	readKeys(strings.NewReader("abc"), func() { quit++ })
	readKeys(strings.NewReader("xq"), func() { quit++ })
	if quit != 1 {
		t.Fatalf("quit %d times, want once (for q)", quit)
	}
}

// tmuxServer is a private tmux server (its own socket and configuration).
type tmuxServer struct {
	t              *testing.T
	bin, dir, sock string
	conf           string
}

func startTmux(t *testing.T, bin string) *tmuxServer {
	t.Helper()
	dir, err := os.MkdirTemp("", "mgpu-tmux") // short: the socket path is limited
	if err != nil {
		t.Fatal(err)
	}
	s := &tmuxServer{t: t, bin: bin, dir: dir, sock: filepath.Join(dir, "s"), conf: filepath.Join(dir, "tmux.conf")}
	if err := os.WriteFile(s.conf, []byte("set -g default-shell /bin/sh\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = s.cmd("kill-server").CombinedOutput()
		_ = os.RemoveAll(dir)
	})
	return s
}

func (s *tmuxServer) cmd(args ...string) *exec.Cmd {
	c := exec.Command(s.bin, append([]string{"-S", s.sock, "-f", s.conf}, args...)...)
	c.Env = slices.DeleteFunc(os.Environ(), func(e string) bool { return strings.HasPrefix(e, "TMUX=") })
	return c
}

func (s *tmuxServer) run(args ...string) string {
	s.t.Helper()
	out, err := s.cmd(args...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("tmux %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// waitFor polls cond until it holds and returns its last report.
func waitFor(t *testing.T, what string, cond func() (bool, string)) string {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ok, last := cond()
		if ok {
			return last
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; last:\n%s", what, last)
		}
		time.Sleep(20 * time.Millisecond) // polling interval
	}
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// sttyModes are the words of stty -a's output (icanon, -echo, ...).
func sttyModes(out string) map[string]bool {
	m := map[string]bool{}
	for _, w := range strings.FieldsFunc(out, func(r rune) bool { return r == ' ' || r == '\n' || r == ';' }) {
		m[w] = true
	}
	return m
}

// TestTopTerminal runs `mgpu-cli top` in a tmux pane (every device without
// an enforcer): the frame is redrawn in place on the alternate screen with
// the terminal in cbreak mode, and q or Ctrl-C ends it with status 0 and
// the terminal as it was.
func TestTopTerminal(t *testing.T) {
	bin, err := exec.LookPath("tmux")
	if err != nil {
		t.Skip("tmux is not installed; this test runs mgpu-cli top in a tmux pane")
	}
	stty, err := exec.LookPath("stty")
	if err != nil {
		t.Skip("stty is not installed; this test reads the pane's terminal modes with it")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, key string }{{"q", "q"}, {"ctrl-c", "C-c"}} {
		t.Run(tc.name, func(t *testing.T) {
			tm := startTmux(t, bin)
			modesFile := filepath.Join(tm.dir, "stty")
			// The shell outlives mgpu-cli (a trap keeps it through Ctrl-C) to
			// print its status and save the terminal's modes after it, then
			// waits (the pane stays until the server is killed).
			script := "trap : INT; " + asMainEnv + "=1 " + shellQuote(exe) + " --config " + shellQuote(simNode) +
				" top --interval 200ms; echo status=$?; stty -a >" + shellQuote(modesFile) + "; echo done; read x"
			tm.run("new-session", "-d", "-s", "top", "-x", "120", "-y", "30", script)
			capture := func() string { return tm.run("capture-pane", "-p", "-t", "top") }
			display := func(format string) string {
				return strings.TrimSpace(tm.run("display-message", "-p", "-t", "top", format))
			}

			first := waitFor(t, "the first frame", func() (bool, string) {
				s := capture()
				return strings.Contains(s, "GPU  STATE") && strings.Contains(s, "no instances"), s
			})
			if !strings.Contains(first, "(q: quit)") || !strings.Contains(first, "\n1    not running  -") {
				t.Errorf("first frame:\n%s", first)
			}
			if got := display("#{alternate_on} #{cursor_flag}"); got != "1 0" {
				t.Errorf("alternate screen, cursor shown: %q, want \"1 0\"", got)
			}
			out, err := exec.Command(stty, "-a", "-F", display("#{pane_tty}")).CombinedOutput()
			if m := sttyModes(string(out)); err != nil || !m["-icanon"] || !m["-echo"] || !m["isig"] {
				t.Errorf("terminal modes while running (want -icanon -echo isig): %v %s", err, out)
			}
			// Later frames replace the first one on the same screen.
			screen := waitFor(t, "another frame", func() (bool, string) {
				s := capture()
				return s != first && strings.Contains(s, "GPU  STATE"), s
			})
			for _, line := range []string{"GPU  STATE", "mgpu top  ", "no instances"} {
				if n := strings.Count(screen, line); n != 1 {
					t.Errorf("%q %d times on the screen:\n%s", line, n, screen)
				}
			}

			tm.run("send-keys", "-t", "top", tc.key)
			after := waitFor(t, "mgpu-cli to exit", func() (bool, string) {
				s := capture()
				return strings.Contains(s, "done\n"), s
			})
			if strings.Contains(after, "GPU  STATE") || strings.Contains(after, "mgpu top") || !strings.HasPrefix(after, "status=0\ndone\n") {
				t.Errorf("screen after mgpu-cli (want the normal screen, status=0):\n%s", after)
			}
			if got := display("#{alternate_on}"); got != "0" {
				t.Errorf("alternate_on %q after mgpu-cli", got)
			}
			modes, err := os.ReadFile(modesFile)
			if m := sttyModes(string(modes)); err != nil || !m["icanon"] || !m["echo"] || !m["isig"] {
				t.Errorf("terminal modes after mgpu-cli (want icanon echo isig): %v %s", err, modes)
			}
		})
	}
}
