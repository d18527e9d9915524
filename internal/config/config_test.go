package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

const simHeader = "version = 1\nbackend = \"sim\"\n[[sim.gpu]]\n"

func TestShippedConfigsLoad(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"config.toml", "sim-node.toml"} {
		c, err := Load(filepath.Join("..", "..", "packaging", "config", name))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if c.Defaults.ComputePolicy != policy.FixedShare || c.Defaults.MaxInstances != 16 {
			t.Errorf("%s: defaults %+v", name, c.Defaults)
		}
		// Real GPUs charge each context memory the shim does not count.
		if want := map[string]int64{"config.toml": 1024, "sim-node.toml": 0}[name]; c.Backstop.MemoryAllowanceMiB != want || !c.Backstop.Enabled {
			t.Errorf("%s: backstop %+v, want memory_allowance_mib %d", name, c.Backstop, want)
		}
	}
	c, _ := Load("../../packaging/config/sim-node.toml")
	if len(c.Sim.GPUs) != 2 || c.Sim.GPUs[1].MemoryMiB != 81920 || c.Sim.GPUs[1].UUID != SimUUID(1) {
		t.Errorf("sim GPUs %+v", c.Sim.GPUs)
	}
}

func TestDefaultsAndOverrides(t *testing.T) {
	t.Parallel()
	c, err := Parse("c.toml", []byte(`version = 1
backend = "sim"
[defaults]
compute_timeslice = 50
online_offline_switch = 1
[[device]]
index = 1
compute_policy = "native-burst-share"
max_instances = 4
online_offline_switch = 0
[[sim.gpu]]
[[sim.gpu]]
name = "Small"
memory_mib = 1024
`))
	if err != nil {
		t.Fatal(err)
	}
	d0, d1 := c.Device(0), c.Device(1)
	if d0.ComputePolicy != policy.FixedShare || d0.Period() != 50*time.Millisecond || d0.MaxInstances != 16 || d0.OnlineOfflineSwitch != 1 {
		t.Errorf("device 0: %+v", d0)
	}
	// A device's 0 overrides the defaults' 1.
	if d1.ComputePolicy != policy.NativeBurstShare || d1.Period() != 50*time.Millisecond || d1.MaxInstances != 4 || d1.OnlineOfflineSwitch != 0 {
		t.Errorf("device 1: %+v", d1)
	}
	if d1.NativeSlice() != 20000*time.Microsecond {
		t.Errorf("native slice %v", d1.NativeSlice())
	}
	if c.Sim.GPUs[0].Name != defaultSimName || c.Sim.GPUs[0].MemoryMiB != defaultSimMemoryMiB {
		t.Errorf("sim defaults not applied: %+v", c.Sim.GPUs[0])
	}
	if c.RunDir != DefaultRunDir || c.DeviceRunDir(1) != "/run/mgpu/gpu1" || c.DeviceStateDir(0) != "/var/lib/mgpu/gpu0" {
		t.Errorf("dirs: %q %q %q", c.RunDir, c.DeviceRunDir(1), c.DeviceStateDir(0))
	}
}

func TestBackstop(t *testing.T) {
	t.Parallel()
	want := BackstopConfig{
		Enabled: true, Interval: 250 * time.Millisecond, Window: time.Second, ComputeTolerance: 10,
		MemoryAllowanceMiB: 1024, MemoryAllowanceProcesses: 4, MemoryOnViolation: "kill", ComputeOnViolation: "log", UnattributedOnViolation: "log",
	}
	if got := Default().Backstop; got != want {
		t.Errorf("Default: %+v, want %+v", got, want)
	}
	c, err := Parse("c.toml", []byte("version = 1\n"))
	if err != nil || c.Backstop != want {
		t.Fatalf("no [backstop]: %+v, %v", c.Backstop, err)
	}
	// The simulated GPU charges exactly what is allocated: no allowance
	// unless the file sets one.
	c, err = Parse("c.toml", []byte("version = 1\nbackend = \"sim\"\n[[sim.gpu]]\n"))
	if err != nil || c.Backstop.MemoryAllowanceMiB != 0 {
		t.Fatalf("sim without [backstop]: %+v, %v", c.Backstop, err)
	}
	c, err = Parse("c.toml", []byte("version = 1\nbackend = \"sim\"\n[backstop]\nmemory_allowance_mib = 64\n[[sim.gpu]]\n"))
	if err != nil || c.Backstop.MemoryAllowanceMiB != 64 {
		t.Fatalf("sim with an allowance: %+v, %v", c.Backstop, err)
	}
	for _, tc := range []struct {
		name, text string
		want       BackstopConfig
	}{
		{"every key", `enabled = false
interval = "100ms"
window = "2.5s"
compute_tolerance = 0
memory_allowance_mib = 512
memory_allowance_processes = 2
memory_on_violation = "log"
compute_on_violation = "kill"
unattributed_on_violation = "kill"
`, BackstopConfig{Interval: 100 * time.Millisecond, Window: 2500 * time.Millisecond, MemoryAllowanceMiB: 512, MemoryAllowanceProcesses: 2,
			MemoryOnViolation: "log", ComputeOnViolation: "kill", UnattributedOnViolation: "kill"}},
		{"some keys", "memory_allowance_mib = 512\n", func() BackstopConfig { b := want; b.MemoryAllowanceMiB = 512; return b }()},
		{"window equal to interval", "interval = \"1s\"\nwindow = \"1s\"\n", func() BackstopConfig {
			b := want
			b.Interval = time.Second
			return b
		}()},
		{"bounds", "interval = \"10ms\"\nwindow = \"1m\"\ncompute_tolerance = 100\nmemory_allowance_mib = 65536\nmemory_allowance_processes = 128\n", func() BackstopConfig {
			b := want
			b.Interval, b.Window, b.ComputeTolerance, b.MemoryAllowanceMiB, b.MemoryAllowanceProcesses = 10*time.Millisecond, time.Minute, 100, 65536, 128
			return b
		}()},
		{"allowance once per instance", "memory_allowance_processes = 1\n", func() BackstopConfig { b := want; b.MemoryAllowanceProcesses = 1; return b }()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, err := Parse("c.toml", []byte("version = 1\n[backstop]\n"+tc.text))
			if err != nil {
				t.Fatal(err)
			}
			if c.Backstop != tc.want {
				t.Errorf("got %+v, want %+v", c.Backstop, tc.want)
			}
		})
	}
	if got := (BackstopConfig{MemoryAllowanceMiB: 512}).MemoryAllowance(); got != 512<<20 {
		t.Errorf("MemoryAllowance %d", got)
	}
}

func TestErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, text string
		line       int
		key, msg   string
	}{
		{"unknown key", simHeader + "[defaults]\nfoo = 1\n", 5, "defaults.foo", "unknown key"},
		{"unknown top-level key", "version = 1\ncolour = 2\n", 2, "colour", "unknown key"},
		{"bad policy", "version = 1\n[defaults]\ncompute_policy = \"fair\"\n", 3, "defaults.compute_policy", `unknown compute policy "fair"`},
		{"bad device policy", "version = 1\n[[device]]\nindex = 0\ncompute_policy = \"x\"\n", 4, "device.compute_policy", `unknown compute policy "x"`},
		{"negative memory", simHeader + "memory_mib = -1\n", 4, "sim.gpu[0].memory_mib", "must be positive"},
		{"duplicate device", "version = 1\n[[device]]\nindex = 2\n[[device]]\nindex = 2\n", 5, "device[1].index", "duplicate device index 2"},
		{"negative index", "version = 1\n[[device]]\nindex = -1\n", 3, "device[0].index", "must be >= 0"},
		{"wrong type", "version = 1\nmax = 1\n", 2, "max", "unknown key"},
		{"string for int", "version = 1\n[defaults]\nmax_instances = \"many\"\n", 3, "defaults.max_instances", "incompatible types"},
		{"zero timeslice", "version = 1\n[defaults]\ncompute_timeslice = 0\n", 3, "defaults.compute_timeslice", "must be 1..10000"},
		{"too many instances", "version = 1\n[defaults]\nmax_instances = 1000\n", 3, "defaults.max_instances", "must be 1..128"},
		{"online_offline_switch 3", "version = 1\n[defaults]\nonline_offline_switch = 3\n", 3, "defaults.online_offline_switch", "must be 0 (off), 1 (offline"},
		{"device online_offline_switch -1", "version = 1\n[[device]]\nindex = 0\nonline_offline_switch = -1\n", 4, "device[0].online_offline_switch", "must be 0 (off), 1 (offline"},
		{"bad backend", "version = 1\nbackend = \"cuda\"\n", 2, "backend", `unknown backend "cuda"`},
		{"sim without gpus", "version = 1\nbackend = \"sim\"\n", 2, "backend", "needs at least one"},
		{"missing version", "backend = \"nvml\"\n", 1, "version", "missing"},
		{"future version", "version = 2\n", 1, "version", "unsupported version 2"},
		{"relative run dir", "version = 1\nrun_dir = \"run\"\n", 2, "run_dir", "absolute path"},
		{"bad kind", "version = 1\ncdi_kind = \"gpu\"\n", 2, "cdi_kind", "vendor/class"},
		{"bad uuid", simHeader + "uuid = \"abc\"\n", 4, "sim.gpu[0].uuid", "GPU-<uuid>"},
		{"syntax", "version = 1\n[defaults\n", 2, "", "table name"},
		{"metrics listen without port", "version = 1\n[metrics]\nlisten = \"127.0.0.1\"\n", 3, "metrics.listen", `must be host:port (e.g. "127.0.0.1:9407")`},
		{"metrics listen bad port", "version = 1\n[metrics]\nlisten = \"127.0.0.1:70000\"\n", 3, "metrics.listen", "port 70000 outside 0..65535"},
		{"metrics listen host name", "version = 1\n[metrics]\nlisten = \"example.com:9407\"\n", 3, "metrics.listen", "not an IP address"},
		{"metrics unknown key", "version = 1\n[metrics]\nport = 9407\n", 3, "metrics.port", "unknown key"},
		{"unknown backstop key", "version = 1\n[backstop]\non_violation = \"kill\"\n", 3, "backstop.on_violation", "unknown key"},
		{"backstop not a bool", "version = 1\n[backstop]\nenabled = \"yes\"\n", 3, "backstop.enabled", "incompatible types"},
		{"interval not a duration", "version = 1\n[backstop]\ninterval = \"fast\"\n", 3, "backstop.interval", `invalid duration: "fast"`},
		{"interval without unit", "version = 1\n[backstop]\ninterval = 250\n", 3, "backstop.interval", `must be a duration 10ms..10s (e.g. "250ms"), got 250ns`},
		{"interval too short", "version = 1\n[backstop]\ninterval = \"5ms\"\n", 3, "backstop.interval", "must be a duration 10ms..10s"},
		{"interval too long", "version = 1\n[backstop]\ninterval = \"11s\"\n", 3, "backstop.interval", "got 11s"},
		{"window shorter than interval", "version = 1\n[backstop]\ninterval = \"500ms\"\nwindow = \"250ms\"\n", 4, "backstop.window", "from backstop.interval (500ms) to 1m0s"},
		{"window too long", "version = 1\n[backstop]\nwindow = \"2m\"\n", 3, "backstop.window", "got 2m0s"},
		{"negative tolerance", "version = 1\n[backstop]\ncompute_tolerance = -1\n", 3, "backstop.compute_tolerance", "must be 0..100"},
		{"tolerance over 100", "version = 1\n[backstop]\ncompute_tolerance = 101\n", 3, "backstop.compute_tolerance", "must be 0..100"},
		{"fractional tolerance", "version = 1\n[backstop]\ncompute_tolerance = 2.5\n", 3, "backstop.compute_tolerance", "incompatible types"},
		{"negative allowance", "version = 1\n[backstop]\nmemory_allowance_mib = -1\n", 3, "backstop.memory_allowance_mib", "must be 0..65536"},
		{"huge allowance", "version = 1\n[backstop]\nmemory_allowance_mib = 65537\n", 3, "backstop.memory_allowance_mib", "must be 0..65536"},
		{"allowance for no process", "version = 1\n[backstop]\nmemory_allowance_processes = 0\n", 3, "backstop.memory_allowance_processes", "must be 1..128 (processes per instance), got 0"},
		{"allowance for too many processes", "version = 1\n[backstop]\nmemory_allowance_processes = 129\n", 3, "backstop.memory_allowance_processes", "must be 1..128"},
		{"bad memory action", "version = 1\n[backstop]\nmemory_on_violation = \"warn\"\n", 3, "backstop.memory_on_violation", `unknown action "warn" (want "log" or "kill")`},
		{"bad compute action", "version = 1\n[backstop]\ncompute_on_violation = \"Kill\"\n", 3, "backstop.compute_on_violation", `unknown action "Kill"`},
		{"bad unattributed action", "version = 1\n[backstop]\nunattributed_on_violation = \"\"\n", 3, "backstop.unattributed_on_violation", `unknown action ""`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse("/etc/mgpu/config.toml", []byte(tc.text))
			var ce *Error
			if !errors.As(err, &ce) {
				t.Fatalf("got %v, want *config.Error", err)
			}
			if ce.File != "/etc/mgpu/config.toml" || ce.Line != tc.line || ce.Key != tc.key || !strings.Contains(ce.Err.Error(), tc.msg) {
				t.Errorf("got %q (line %d key %q), want line %d key %q containing %q", err, ce.Line, ce.Key, tc.line, tc.key, tc.msg)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error is not one line: %q", err)
			}
		})
	}
}

func TestLoadMissingFile(t *testing.T) {
	t.Parallel()
	_, err := Load(filepath.Join(t.TempDir(), "nope.toml"))
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "nope.toml") {
		t.Fatalf("got %v", err)
	}
}

func TestResolve(t *testing.T) {
	t.Setenv(EnvPath, "/tmp/from-env.toml")
	if got := Resolve("/x.toml"); got != "/x.toml" {
		t.Errorf("flag: %q", got)
	}
	if got := Resolve(""); got != "/tmp/from-env.toml" {
		t.Errorf("env: %q", got)
	}
	if err := os.Unsetenv(EnvPath); err != nil {
		t.Fatal(err)
	}
	if got := Resolve(""); got != DefaultPath {
		t.Errorf("default: %q", got)
	}
}

func FuzzParse(f *testing.F) {
	for _, name := range []string{"config.toml", "sim-node.toml"} {
		if b, err := os.ReadFile(filepath.Join("..", "..", "packaging", "config", name)); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte(simHeader + "memory_mib = -1\n"))
	f.Add([]byte("version = 1\n[[device]]\nindex = 2\n[[device]]\nindex = 2\n"))
	f.Add([]byte("version = 1\n[backstop]\ninterval = \"100ms\"\nwindow = \"1s\"\ncompute_tolerance = 10\nmemory_allowance_mib = 512\nmemory_on_violation = \"kill\"\n"))
	f.Add([]byte("version = 1\n[backstop]\ninterval = 250\nwindow = \"1x\"\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("fuzz.toml", data)
		if err != nil {
			var ce *Error
			if !errors.As(err, &ce) {
				t.Fatalf("error of type %T: %v", err, err)
			}
			if strings.ContainsAny(ce.Key, "\n") {
				t.Fatalf("multi-line key in %q", err)
			}
			return
		}
		// Anything accepted must be valid by the rules the enforcer relies on.
		if err := c.validate(); err != nil {
			t.Fatalf("accepted config fails validation: %v", err)
		}
		seen := map[int]bool{}
		for _, d := range c.Devices {
			if seen[d.Index] || d.Index < 0 {
				t.Fatalf("accepted bad device index %d", d.Index)
			}
			seen[d.Index] = true
		}
		for _, g := range c.Sim.GPUs {
			if g.MemoryMiB <= 0 {
				t.Fatalf("accepted memory %d", g.MemoryMiB)
			}
		}
		b := c.Backstop
		if b.Interval < MinBackstopInterval || b.Window < b.Interval || b.Window > MaxBackstopWindow ||
			b.ComputeTolerance < 0 || b.ComputeTolerance > 100 || b.MemoryAllowanceMiB < 0 {
			t.Fatalf("accepted backstop %+v", b)
		}
		for _, a := range []string{b.MemoryOnViolation, b.ComputeOnViolation, b.UnattributedOnViolation} {
			if a != OnViolationLog && a != OnViolationKill {
				t.Fatalf("accepted action %q", a)
			}
		}
	})
}

func TestSimTopology(t *testing.T) {
	t.Parallel()
	const gpus = "[[sim.gpu]]\n[[sim.gpu]]\n[[sim.gpu]]\n"
	cfg, err := Parse("c.toml", []byte("version = 1\nbackend = \"sim\"\n[sim]\ntopology = [[\"X\", \"PIX\", \"SYS\"], [\"PIX\", \"X\", \"SYS\"], [\"SYS\", \"SYS\", \"X\"]]\n"+gpus))
	if err != nil || len(cfg.Sim.Topology) != 3 || cfg.Sim.Topology[0][1] != "PIX" {
		t.Fatalf("%+v %v", cfg.Sim.Topology, err)
	}
	for _, tc := range []struct{ name, topo, key, msg string }{
		{"rows", `[["X", "PIX", "SYS"]]`, "sim.topology", "has 1 rows for 3 GPUs"},
		{"columns", `[["X", "PIX"], ["PIX", "X"], ["SYS", "SYS"]]`, "sim.topology[0]", "has 2 entries for 3 GPUs"},
		{"unknown link", `[["X", "NV4", "SYS"], ["NV4", "X", "SYS"], ["SYS", "SYS", "X"]]`, "sim.topology[0][1]", `unknown link "NV4" (want one of X, PIX, PXB, PHB, NODE, SYS)`},
		{"diagonal", `[["PIX", "PIX", "SYS"], ["PIX", "X", "SYS"], ["SYS", "SYS", "X"]]`, "sim.topology[0][0]", "X is a GPU's link to itself"},
		{"asymmetric", `[["X", "PIX", "SYS"], ["PXB", "X", "SYS"], ["SYS", "SYS", "X"]]`, "sim.topology[0][1]", `"PIX", but sim.topology[1][0] is "PXB"`},
	} {
		_, err := Parse("c.toml", []byte("version = 1\nbackend = \"sim\"\n[sim]\ntopology = "+tc.topo+"\n"+gpus))
		var ce *Error
		if !errors.As(err, &ce) || ce.Key != tc.key || !strings.Contains(ce.Err.Error(), tc.msg) {
			t.Errorf("%s: %v, want key %s and %q", tc.name, err, tc.key, tc.msg)
		}
	}
}
