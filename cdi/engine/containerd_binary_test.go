package engine

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"
)

// containerdBinary finds a containerd 2.x binary: $MGPU_CONTAINERD, PATH,
// or the cache test/e2e/deps.sh installs into.
func containerdBinary(t *testing.T) string {
	t.Helper()
	candidates := []string{os.Getenv("MGPU_CONTAINERD")}
	if p, err := exec.LookPath("containerd"); err == nil {
		candidates = append(candidates, p)
	}
	cache := os.Getenv("MGPU_E2E_CACHE")
	if cache == "" {
		cache = "/var/cache/mgpu-e2e"
	}
	candidates = append(candidates, filepath.Join(cache, "bin", "containerd"))
	for _, c := range candidates {
		if c == "" {
			continue
		}
		out, err := exec.Command(c, "--version").Output() //nolint:gosec // test binary
		if err != nil {
			continue
		}
		// "containerd github.com/containerd/containerd/v2 2.4.2 ..."
		if f := strings.Fields(string(out)); len(f) >= 3 && strings.HasPrefix(strings.TrimPrefix(f[2], "v"), "2.") {
			return c
		}
	}
	t.Skip("no containerd 2.x binary (set MGPU_CONTAINERD, or run test/e2e/deps.sh)")
	return ""
}

// dump runs `containerd --config main config dump`: containerd loads main
// and its imports exactly as it does when it starts.
func dump(t *testing.T, bin, main string) (map[string]any, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "--config", main, "config", "dump") //nolint:gosec // test binary
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("containerd config dump: %v\n%s", err, stderr.String())
	}
	var m map[string]any
	if _, err := toml.Decode(stdout.String(), &m); err != nil {
		t.Fatalf("config dump is not TOML: %v", err)
	}
	return m, stderr.String()
}

func criRuntime(t *testing.T, m map[string]any) map[string]any {
	t.Helper()
	p, _ := m["plugins"].(map[string]any)
	rt, ok := p["io.containerd.cri.v1.runtime"].(map[string]any)
	if !ok {
		t.Fatalf("config dump has no io.containerd.cri.v1.runtime plugin: %v", p)
	}
	return rt
}

func TestContainerdLoadsTheDropIn(t *testing.T) {
	t.Parallel()
	bin := containerdBinary(t)
	for _, tc := range []struct {
		name    string
		version string
		main    string
	}{
		{name: "2.x", version: Containerd2, main: mainConfig},
		// containerd 2.x migrates a 1.7 (version 2) drop-in and main config.
		{name: "1.7 files", version: Containerd17, main: "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  max_container_log_line_size = 9999\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			main, dropIn := filepath.Join(dir, "config.toml"), filepath.Join(dir, "conf.d", "mgpu.toml")
			write(t, main, strings.Replace(tc.main, `root = "/var/lib/containerd"`, `root = "`+filepath.Join(dir, "root")+`"`, 1))
			dirs := []string{"/etc/cdi", "/var/run/cdi", filepath.Join(dir, "cdi")}
			before, _ := dump(t, bin, main)
			if got := criRuntime(t, before)["cdi_spec_dirs"]; slices.Contains(toStrings(got), dirs[2]) {
				t.Fatalf("cdi_spec_dirs before configuring = %v", got)
			}
			plan, err := Containerd(ContainerdOptions{Config: main, DropIn: dropIn, Version: tc.version, SpecDirs: dirs})
			if err != nil {
				t.Fatal(err)
			}
			if err := plan.Apply(); err != nil {
				t.Fatal(err)
			}
			after, stderr := dump(t, bin, main)
			rt := criRuntime(t, after)
			if got := toStrings(rt["cdi_spec_dirs"]); !slices.Equal(got, dirs) {
				t.Errorf("cdi_spec_dirs = %v, want %v", got, dirs)
			}
			// CDI is on: containerd 2.x has no switch for it any more; an
			// older 2.x dumps enable_cdi, which must then be true.
			if v, ok := rt["enable_cdi"]; ok && v != true {
				t.Errorf("enable_cdi = %v", v)
			}
			if rt["max_container_log_line_size"] != int64(9999) {
				t.Errorf("the main config's max_container_log_line_size was lost: %v", rt["max_container_log_line_size"])
			}
			if tc.version == Containerd2 {
				if strings.Contains(stderr, "unknown key") {
					t.Errorf("containerd warns about the drop-in:\n%s", stderr)
				}
				opts := rt["containerd"].(map[string]any)["runtimes"].(map[string]any)["runc"].(map[string]any)["options"].(map[string]any)
				if opts["SystemdCgroup"] != true {
					t.Errorf("the main config's runc options were lost: %v", opts)
				}
			}
			if imp := toStrings(after["imports"]); !slices.Contains(imp, dropIn) {
				t.Errorf("imports = %v, want %s", imp, dropIn)
			}
		})
	}
}

func toStrings(v any) []string {
	list, _ := v.([]any)
	var out []string
	for _, x := range list {
		if s, ok := x.(string); ok {
			out = append(out, s)
		}
	}
	return out
}
