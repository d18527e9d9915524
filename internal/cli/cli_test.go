package cli

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

var update = flag.Bool("update", false, "rewrite golden files in testdata/")

const simNodeFile = "../../packaging/config/sim-node.toml"

// simNode is the shipped simulated node with its run and state directories
// moved under a temporary directory, so that nothing on the machine (device
// nodes, running enforcers) changes the output.
var simNode string

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "mgpu-cli-test")
	if err != nil {
		panic(err)
	}
	b, err := os.ReadFile(simNodeFile)
	if err != nil {
		panic(err)
	}
	prefix := fmt.Sprintf("run_dir = %q\nstate_dir = %q\n", filepath.Join(dir, "run"), filepath.Join(dir, "state"))
	simNode = filepath.Join(dir, "sim-node.toml")
	if err := os.WriteFile(simNode, append([]byte(prefix), b...), 0o644); err != nil {
		panic(err)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// run runs mgpu-cli in-process and returns stdout, stderr and the status.
func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Main(append([]string{"mgpu-cli"}, args...), &out, &errb)
	return out.String(), errb.String(), code
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./internal/cli -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from golden file:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

// seedFields are the 17 fields of the seed's table, in its order.
var seedFields = []string{
	"device_id", "compute_free_weight", "compute_free_weight_online", "compute_load_balance_mode",
	"compute_policy", "compute_qos_enabled", "compute_qos_enabled_native_burst", "compute_timeslice",
	"compute_timeslice_native_burst", "compute_total_weight_native_burst", "device_major",
	"instance_deploy_mode", "instance_major", "online_offline_switch", "user_instance_major",
	"vmem_free_bytes", "vmem_limit",
}

func TestDeviceInfoTable(t *testing.T) {
	out, stderr, code := run(t, "--config", simNode, "device", "info", "-a")
	if code != 0 {
		t.Fatalf("status %d: %s", code, stderr)
	}
	golden(t, "device-info-sim.txt", out)
	tables := strings.Split(strings.TrimSpace(out), "\n\n")
	if len(tables) != 2 {
		t.Fatalf("got %d tables, want 2", len(tables))
	}
	for ti, tab := range tables {
		var names []string
		for _, line := range strings.Split(tab, "\n") {
			if strings.HasPrefix(line, "| ") {
				names = append(names, strings.TrimSpace(strings.Split(line, "|")[1]))
			}
		}
		if strings.Join(names, ",") != strings.Join(seedFields, ",") {
			t.Errorf("table %d fields %v, want %v", ti, names, seedFields)
		}
	}
}

func TestDeviceInfoJSON(t *testing.T) {
	out, stderr, code := run(t, "--config", simNode, "device", "info", "-a", "--output", "json")
	if code != 0 {
		t.Fatalf("status %d: %s", code, stderr)
	}
	golden(t, "device-info-sim.json", out)
	var reports []map[string]any
	if err := json.Unmarshal([]byte(out), &reports); err != nil {
		t.Fatal(err)
	}
	if len(reports) != 2 {
		t.Fatalf("%d devices", len(reports))
	}
	for _, r := range reports {
		if len(r) != len(seedFields) {
			t.Errorf("%d fields, want %d", len(r), len(seedFields))
		}
		for _, f := range seedFields {
			if _, ok := r[f]; !ok {
				t.Errorf("missing %q", f)
			}
		}
	}
	if reports[1]["vmem_free_bytes"].(float64) != 81920*1024*1024 || reports[1]["vmem_limit"] != "81920 MiB" {
		t.Errorf("device 1: %v", reports[1])
	}
}

func TestDeviceInfoOneDevice(t *testing.T) {
	out, _, code := run(t, "--config", simNode, "device", "info", "--device", "1")
	if code != 0 || strings.Count(out, "| device_id") != 1 || !strings.Contains(out, "| device_id                         | 1 ") {
		t.Fatalf("status %d:\n%s", code, out)
	}
}

func TestNodeLabels(t *testing.T) {
	for _, format := range []string{"labels", "nfd"} {
		out, stderr, code := run(t, "--config", simNode, "node", "labels", "--format", format)
		if code != 0 {
			t.Fatalf("%s: status %d: %s", format, code, stderr)
		}
		golden(t, "node-labels-"+format+".txt", out)
	}
}

func TestNodeLabelsToFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mgpu.txt")
	if _, stderr, code := run(t, "--config", simNode, "node", "labels", "--output-file", path); code != 0 {
		t.Fatalf("status %d: %s", code, stderr)
	}
	b, err := os.ReadFile(path)
	if err != nil || !strings.Contains(string(b), "aliyun.accelerator/nvidia_count=2\n") {
		t.Fatalf("%q, %v", b, err)
	}
}

func TestErrorsExitStatus(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("version = 1\n[defaults]\ncompute_policy = \"fair\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{"bad config", []string{"--config", bad, "device", "info", "-a"}, 2, bad + `:3: key "defaults.compute_policy": unknown compute policy "fair"`},
		{"missing config", []string{"--config", filepath.Join(dir, "none.toml"), "device", "info", "-a"}, 2, "configuration file not found"},
		{"no device selection", []string{"--config", simNode, "device", "info"}, 2, "say which devices"},
		{"unknown device", []string{"--config", simNode, "device", "info", "--device", "7"}, 2, "no GPU with index 7"},
		{"bad output", []string{"--config", simNode, "device", "info", "-a", "-o", "xml"}, 2, `unknown --output "xml"`},
		{"bad label format", []string{"--config", simNode, "node", "labels", "--format", "yaml"}, 2, `unknown --format "yaml"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr, code := run(t, tc.args...)
			if code != tc.code || !strings.HasPrefix(stderr, "mgpu: ") || !strings.Contains(stderr, tc.stderr) {
				t.Errorf("status %d stderr %q, want %d containing %q", code, stderr, tc.code, tc.stderr)
			}
			if strings.Count(stderr, "\n") != 1 {
				t.Errorf("stderr is not one line: %q", stderr)
			}
			if out != "" {
				t.Errorf("stdout not empty: %q", out)
			}
		})
	}
}

func TestVersion(t *testing.T) {
	out, _, code := run(t, "version")
	if code != 0 || !strings.HasPrefix(out, "mgpu-cli ") {
		t.Fatalf("%d %q", code, out)
	}
}

// The device report's weights with online/offline co-location: offline
// cores count in the total and in compute_free_weight, not in
// compute_free_weight_online; the switch shown is the running enforcer's.
func TestDeviceReportOnlineOffline(t *testing.T) {
	dev := device.Info{Index: 0, MemoryBytes: 81920 << 20}
	s := config.Default().Defaults
	r := NewDeviceReport(dev, s, Allocation{Instances: 3, CoreSum: 70, OfflineSum: 50, Switch: 1, Live: true})
	if r.ComputeFreeWeight != 0 || r.ComputeFreeWeightOnline != 30 || r.ComputeTotalWeightNativeBurst != 120 || r.OnlineOfflineSwitch != 1 {
		t.Errorf("live, 70 online + 50 offline: %+v", r)
	}
	s.OnlineOfflineSwitch = 1
	r = NewDeviceReport(dev, s, Allocation{})
	if r.ComputeFreeWeight != 100 || r.ComputeFreeWeightOnline != 100 || r.OnlineOfflineSwitch != 1 {
		t.Errorf("no enforcer, the config's switch 1: %+v", r)
	}
}
