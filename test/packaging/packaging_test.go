// Package packaging_test checks `make package` and the packages it builds:
// their file lists, the systemd units, and, as root on Debian, a real
// dpkg install, removal, reinstall and an upgrade under a running enforcer,
// and the container suite (test/e2e) and the Helm chart in package mode
// (test/k8s's TestChartInstall/package) run on the installed package.
//
// The install tests install onto this machine rather than into a
// debootstrap chroot: a chroot costs minutes and a few hundred MiB per run,
// while the package only touches its own paths (/usr/bin/mgpu-*,
// /usr/lib/mgpu, /usr/libexec/mgpu, its units, /etc/mgpu). The tests refuse
// to run (skip) when any of those already exists, and purge the package at
// the end, so the machine is left as it was.
package packaging_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/cdi"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/test/e2e"
)

// The two versions the tests build: the upgrade goes from the first to the
// second.
const (
	v1 = "0.0.1"
	v2 = "0.0.2"
)

var (
	buildOnce sync.Once
	buildDir  string // the BUILD of both versions; dist/ holds the packages
	buildErr  error
	buildLog  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		_ = os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func needTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (apt-get install %s)", tool, aptName(tool))
		}
	}
}

func aptName(tool string) string {
	switch tool {
	case "systemd-analyze":
		return "systemd"
	case "dpkg-deb", "dpkg":
		return "dpkg"
	case "unshare":
		return "util-linux"
	}
	return tool
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("installing packages needs root")
	}
}

// packages runs `make package` for v1 and v2 into one scratch BUILD (never
// the repository's build/, which other tests run binaries from) and returns
// its dist directory.
func packages(t *testing.T) string {
	t.Helper()
	needTools(t, "make", "go")
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "mgpu-pkg-")
		if buildErr != nil {
			return
		}
		var log bytes.Buffer
		for _, v := range []string{v1, v2} {
			cmd := exec.Command("make", "--no-print-directory", "package", "BUILD="+buildDir, "VERSION="+v)
			cmd.Dir = repoRoot(t)
			cmd.Stdout, cmd.Stderr = &log, &log
			if buildErr = cmd.Run(); buildErr != nil {
				buildErr = fmt.Errorf("make package VERSION=%s: %w", v, buildErr)
				break
			}
		}
		buildLog = log.String()
	})
	if buildErr != nil {
		t.Fatalf("%v\n%s", buildErr, buildLog)
	}
	return filepath.Join(buildDir, "dist")
}

func debFile(dist, v string) string { return filepath.Join(dist, "mgpu_"+v+"_amd64.deb") }
func rpmFile(dist, v string) string { return filepath.Join(dist, "mgpu-"+v+"-1.x86_64.rpm") }

// expectedFiles is every regular file the packages install, with its mode.
func expectedFiles(t *testing.T) map[string]os.FileMode {
	t.Helper()
	files := map[string]os.FileMode{
		"/usr/bin/mgpu-cli":                                   0o755,
		"/usr/bin/kubectl-inspect-mgpu":                       0o755,
		"/usr/bin/mgpu-device-plugin":                         0o755,
		"/usr/bin/mgpu-enforcer":                              0o755,
		"/usr/bin/mgpu-hook":                                  0o755,
		"/usr/lib/mgpu/libmgpu-shim.so":                       0o644,
		"/usr/lib/mgpu/ld.so.preload":                         0o644,
		"/usr/libexec/mgpu/mgpu-start-enforcers":              0o755,
		"/etc/mgpu/config.toml":                               0o644,
		"/usr/lib/systemd/system/mgpu-enforcer@.service":      0o644,
		"/usr/lib/systemd/system/mgpu-enforcers.service":      0o644,
		"/usr/lib/systemd/system/mgpu-cdi-refresh.service":    0o644,
		"/usr/lib/systemd/system/mgpu-cdi-refresh.path":       0o644,
		"/usr/lib/systemd/system/mgpu-device-plugin.service":  0o644,
		"/usr/lib/systemd/system/mgpu-metrics.service":        0o644,
		"/usr/lib/systemd/system-preset/90-mgpu.preset":       0o644,
		"/usr/share/doc/mgpu/examples/containerd-mgpu.toml":   0o644,
		"/usr/share/doc/mgpu/examples/docker-daemon.json":     0o644,
		"/usr/share/doc/mgpu/examples/grafana-dashboard.json": 0o644,
		"/usr/share/doc/mgpu/examples/sim-node.toml":          0o644,
		"/usr/share/doc/mgpu/README.md":                       0o644,
		"/usr/share/doc/mgpu/LICENSE":                         0o644,
	}
	// The docs that make package staged (docs/*.md at build time).
	docs, err := filepath.Glob(filepath.Join(buildDir, "pkg", "doc", "docs", "*.md"))
	if err != nil || len(docs) == 0 {
		t.Fatalf("no staged docs/*.md: %v", err)
	}
	for _, d := range docs {
		files["/usr/share/doc/mgpu/"+filepath.Base(d)] = 0o644
	}
	return files
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// debContents parses `dpkg-deb -c`: path -> mode of regular files.
func debContents(t *testing.T, deb string) map[string]os.FileMode {
	t.Helper()
	got := map[string]os.FileMode{}
	for _, line := range strings.Split(strings.TrimSpace(run(t, "dpkg-deb", "-c", deb)), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 || f[0][0] != '-' {
			continue
		}
		got[strings.TrimPrefix(f[5], ".")] = permBits(t, f[0])
	}
	return got
}

func permBits(t *testing.T, s string) os.FileMode {
	t.Helper()
	var m os.FileMode
	for i, c := range s[1:10] {
		if c != '-' {
			m |= 1 << (8 - i)
		}
	}
	return m
}

func TestMakePackage(t *testing.T) {
	needTools(t, "dpkg-deb", "rpm")
	dist := packages(t)
	want := expectedFiles(t)

	t.Run("deb", func(t *testing.T) {
		deb := debFile(dist, v1)
		got := debContents(t, deb)
		want := maps(want, map[string]os.FileMode{"/usr/share/doc/mgpu/copyright": 0o644})
		if d := diffModes(want, got); d != "" {
			t.Errorf("dpkg-deb -c %s:\n%s", deb, d)
		}
		if v := strings.TrimSpace(run(t, "dpkg-deb", "-f", deb, "Version")); v != v1 {
			t.Errorf("Version %q, want %q", v, v1)
		}
		if c := strings.TrimSpace(run(t, "dpkg-deb", "--info", deb, "conffiles")); c != "/etc/mgpu/config.toml" {
			t.Errorf("conffiles %q, want /etc/mgpu/config.toml", c)
		}
		for _, s := range []string{"postinst", "prerm", "postrm"} {
			if out := run(t, "dpkg-deb", "--info", deb, s); !strings.HasPrefix(out, "#!/bin/sh") {
				t.Errorf("%s is not the packaging script: %.60q", s, out)
			}
		}
		// The preload file says what the CDI spec expects it to say.
		out, err := exec.Command("sh", "-c", "dpkg-deb --fsys-tarfile \"$1\" | tar -xOf - ./usr/lib/mgpu/ld.so.preload", "sh", deb).Output()
		if err != nil {
			t.Fatal(err)
		}
		if want := cdi.PreloadContent(config.Default()); !bytes.Equal(out, want) {
			t.Errorf("ld.so.preload %q, want %q", out, want)
		}
	})

	t.Run("rpm", func(t *testing.T) {
		rpm := rpmFile(dist, v1)
		got := strings.Split(strings.TrimSpace(run(t, "rpm", "-qlp", rpm)), "\n")
		var wantList []string
		for f := range want {
			wantList = append(wantList, f)
		}
		// Directories the rpm owns so that erasing it removes them.
		wantList = append(wantList, "/etc/mgpu", "/usr/lib/mgpu", "/usr/libexec/mgpu", "/usr/share/doc/mgpu", "/usr/share/doc/mgpu/examples")
		slices.Sort(got)
		slices.Sort(wantList)
		if !slices.Equal(got, wantList) {
			t.Errorf("rpm -qlp %s:\n got %q\nwant %q", rpm, got, wantList)
		}
		if c := strings.TrimSpace(run(t, "rpm", "-qp", "--configfiles", rpm)); c != "/etc/mgpu/config.toml" {
			t.Errorf("config files %q, want /etc/mgpu/config.toml", c)
		}
		if v := run(t, "rpm", "-qp", "--queryformat", "%{VERSION}-%{RELEASE}", rpm); v != v1+"-1" {
			t.Errorf("version %q, want %s-1", v, v1)
		}
		// %config(noreplace): flag 16 is RPMFILE_NOREPLACE, 1 RPMFILE_CONFIG.
		flags := run(t, "rpm", "-qp", "--queryformat", "[%{FILENAMES} %{FILEFLAGS}\n]", rpm)
		if !regexp.MustCompile(`(?m)^/etc/mgpu/config.toml 17$`).MatchString(flags) {
			t.Errorf("/etc/mgpu/config.toml is not %%config(noreplace):\n%s", flags)
		}
		scripts := run(t, "rpm", "-qp", "--scripts", rpm)
		for _, s := range []string{"postinstall scriptlet", "preuninstall scriptlet", "postuninstall scriptlet", "mgpu-enforcers.service"} {
			if !strings.Contains(scripts, s) {
				t.Errorf("rpm --scripts lacks %q", s)
			}
		}
	})
}

func maps(a, b map[string]os.FileMode) map[string]os.FileMode {
	out := map[string]os.FileMode{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

func diffModes(want, got map[string]os.FileMode) string {
	var b strings.Builder
	for f, m := range want {
		g, ok := got[f]
		switch {
		case !ok:
			fmt.Fprintf(&b, "  missing %s\n", f)
		case g != m:
			fmt.Fprintf(&b, "  %s mode %v, want %v\n", f, g, m)
		}
	}
	for f := range got {
		if _, ok := want[f]; !ok {
			fmt.Fprintf(&b, "  unexpected %s\n", f)
		}
	}
	return b.String()
}

// TestUnitsVerify runs systemd-analyze verify on the repository's units,
// with the installed paths pointed at this build's binaries, and checks the
// hardening scores of the enforcer and the device plugin.
// TestDebInstallUpgradeRemove verifies the installed units as they are.
func TestUnitsVerify(t *testing.T) {
	needTools(t, "systemd-analyze")
	root := repoRoot(t)
	bin := filepath.Join(root, "build", "bin")
	for _, b := range []string{"mgpu-cli", "mgpu-enforcer", "mgpu-device-plugin"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Skipf("%s not built (make build): %v", b, err)
		}
	}
	dir := t.TempDir()
	units, err := filepath.Glob(filepath.Join(root, "packaging", "systemd", "mgpu-*.*"))
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, u := range units {
		if ext := filepath.Ext(u); ext != ".service" && ext != ".path" {
			continue
		}
		data, err := os.ReadFile(u)
		if err != nil {
			t.Fatal(err)
		}
		s := strings.ReplaceAll(string(data), "/usr/bin/", bin+"/")
		s = strings.ReplaceAll(s, "/usr/libexec/mgpu/", filepath.Join(root, "packaging", "systemd")+"/")
		p := filepath.Join(dir, filepath.Base(u))
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	if len(paths) != 6 {
		t.Fatalf("units %q, want 6", paths)
	}
	verifyUnits(t, paths...)

	// ProtectSystem, ProtectHome, NoNewPrivileges and friends each count,
	// so losing any of them shows here.
	for _, u := range []struct {
		unit string
		max  float64
	}{
		{"mgpu-enforcer@.service", 5.0},     // 4.6 now
		{"mgpu-device-plugin.service", 3.0}, // 2.5 now: no capabilities; TCP only to reach the API server
		{"mgpu-metrics.service", 3.0},       // no capabilities, writes nothing; TCP to serve
	} {
		if level, out := exposure(t, filepath.Join(dir, u.unit)); level > u.max {
			t.Errorf("%s exposure %.1f, want <= %.1f:\n%s", u.unit, level, u.max, out)
		}
	}

	// The device plugin is on only where an operator turns it on: the
	// preset disables it, the others it enables.
	preset, err := os.ReadFile(filepath.Join(root, "packaging", "systemd", "90-mgpu.preset"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"enable mgpu-enforcers.service", "disable mgpu-device-plugin.service", "disable mgpu-metrics.service"} {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(want) + `$`).Match(preset) {
			t.Errorf("90-mgpu.preset has no line %q:\n%s", want, preset)
		}
	}
}

// exposure is systemd-analyze security's overall exposure level of a unit
// file, with its full output.
func exposure(t *testing.T, unit string) (float64, []byte) {
	t.Helper()
	out, err := exec.Command("systemd-analyze", "security", "--offline=yes", unit).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security %s: %v\n%s", unit, err, out)
	}
	m := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no exposure level in:\n%s", out)
	}
	level, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatalf("exposure level %q: %v", m[1], err)
	}
	return level, out
}

func verifyUnits(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		out, err := exec.Command("systemd-analyze", "verify", "--man=no", p).CombinedOutput()
		if err != nil || len(bytes.TrimSpace(out)) != 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", p, err, out)
		}
	}
}

// node is the installed-package environment of TestDebInstallUpgradeRemove.
type node struct {
	t      *testing.T
	tmp    string // run, state, cdi dirs of the sim config
	state  string // the fake systemctl's state
	fake   string // the fake systemctl
	runDir string
}

// packagePaths are what the package installs or creates; a machine where
// one exists already is not touched.
var packagePaths = []string{
	"/usr/bin/mgpu-cli", "/usr/bin/kubectl-inspect-mgpu", "/usr/bin/mgpu-enforcer", "/usr/bin/mgpu-hook", "/usr/bin/mgpu-device-plugin",
	"/usr/lib/mgpu", "/usr/libexec/mgpu", "/etc/mgpu", "/var/lib/mgpu", "/run/mgpu",
	"/usr/lib/systemd/system/mgpu-enforcer@.service", "/usr/lib/systemd/system/mgpu-device-plugin.service",
}

// inFakeSystemd runs a command in a private mount namespace whose /run has
// /run/systemd/system and whose /usr/bin/systemctl is the fake: the
// maintainer scripts see a running systemd and drive the fake, which runs
// the installed units' commands.
func (n *node) inFakeSystemd(args ...string) (string, error) {
	script := `set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/systemd/system
mount --bind "$1" /usr/bin/systemctl
shift
exec "$@"`
	cmd := exec.Command("unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "sh", n.fake}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (n *node) mustFakeSystemd(args ...string) string {
	n.t.Helper()
	out, err := n.inFakeSystemd(args...)
	if err != nil {
		n.t.Fatalf("%s (fake systemd): %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// calls returns the fake systemctl's calls since the previous call of calls.
func (n *node) calls() []string {
	n.t.Helper()
	data, err := os.ReadFile(filepath.Join(n.state, "calls"))
	if err != nil && !os.IsNotExist(err) {
		n.t.Fatal(err)
	}
	_ = os.Remove(filepath.Join(n.state, "calls"))
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

func (n *node) enforcerPID() int {
	n.t.Helper()
	data, err := os.ReadFile(filepath.Join(n.state, "mgpu-enforcer@0.service.pid"))
	if err != nil {
		n.t.Fatalf("no enforcer started: %v\nlog: %s", err, n.enforcerLog())
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		n.t.Fatal(err)
	}
	return pid
}

func (n *node) enforcerLog() string {
	data, _ := os.ReadFile(filepath.Join(n.state, "mgpu-enforcer@0.service.log"))
	return string(data)
}

// alive reports whether pid runs (a zombie does not).
func alive(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}

func (n *node) client() *http.Client {
	sock := filepath.Join(n.runDir, "gpu0", "control.sock")
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}},
	}
}

type instance struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
}

// instances polls GET /v1/instances until the enforcer answers (it may be
// starting) and returns its instances.
func (n *node) instances() []instance {
	n.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := n.client().Get("http://mgpu/v1/instances")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				n.t.Fatalf("GET /v1/instances: %s: %s", resp.Status, body)
			}
			var list struct {
				Instances []instance `json:"instances"`
			}
			if err := json.Unmarshal(body, &list); err != nil {
				n.t.Fatalf("GET /v1/instances: %v: %s", err, body)
			}
			return list.Instances
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("enforcer does not answer on its control socket: %v\nlog: %s", err, n.enforcerLog())
		}
		time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline
	}
}

func (n *node) create(pid int) instance {
	n.t.Helper()
	n.instances() // wait for the enforcer
	body := fmt.Sprintf(`{"kind":"process-tree","container_id":"mgpu-packaging-test","pid":%d,"core":30,"memory_mib":1024}`, pid)
	resp, err := n.client().Post("http://mgpu/v1/instances", "application/json", strings.NewReader(body))
	if err != nil {
		n.t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		n.t.Fatalf("POST /v1/instances: %s: %s", resp.Status, data)
	}
	var out struct {
		Instance instance `json:"instance"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		n.t.Fatalf("POST /v1/instances: %v: %s", err, data)
	}
	in := out.Instance
	if !strings.HasPrefix(in.Name, "mgpu0inst") {
		n.t.Fatalf("POST /v1/instances: no instance name in %s", data)
	}
	return in
}

func dpkgStatus(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Version}", "mgpu").Output()
	if err != nil {
		return "" // not known to dpkg
	}
	return strings.TrimSpace(string(out))
}

func exists(p string) bool { _, err := os.Lstat(p); return err == nil }

// TestDebInstallUpgradeRemove installs v1 (no systemd: the scripts only
// enable units), removes it keeping the edited configuration, reinstalls it
// and upgrades to v2 under the fake systemd with an enforcer running and an
// instance created through its control API, checks that the upgrade
// restarted the enforcer with the new binary and kept the instance, removes
// the package under the fake systemd (enforcer stopped, CDI spec removed,
// configuration kept) and purges it.
func TestDebInstallUpgradeRemove(t *testing.T) {
	needRoot(t)
	needTools(t, "dpkg", "dpkg-deb", "dpkg-query", "systemd-analyze", "systemctl", "unshare", "setsid")
	if !exists("/usr/bin/systemctl") {
		t.Skip("/usr/bin/systemctl missing: the fake systemd replaces that file")
	}
	machineFree(t)
	dist := packages(t)

	tmp := t.TempDir()
	n := &node{t: t, tmp: tmp, state: filepath.Join(tmp, "systemd"), runDir: filepath.Join(tmp, "run")}
	if err := os.MkdirAll(n.state, 0o755); err != nil {
		t.Fatal(err)
	}
	fake, err := os.ReadFile("testdata/fake-systemctl")
	if err != nil {
		t.Fatal(err)
	}
	n.fake = filepath.Join(tmp, "systemctl")
	if err := os.WriteFile(n.fake, bytes.ReplaceAll(fake, []byte("@STATE@"), []byte(n.state)), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Stop what the fake started, then purge (no systemd: files only).
		for _, f := range must(filepath.Glob(filepath.Join(n.state, "*.pid"))) {
			if b, err := os.ReadFile(f); err == nil {
				if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && alive(pid) {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		if out, err := exec.Command("dpkg", "--purge", "mgpu").CombinedOutput(); err != nil {
			t.Errorf("cleanup: dpkg --purge mgpu: %v\n%s", err, out)
		}
		for _, p := range packagePaths {
			if exists(p) {
				t.Errorf("cleanup: %s is left after the purge", p)
			}
		}
	})

	// 1. Install v1 without systemd.
	out := run(t, "dpkg", "-i", debFile(dist, v1))
	if !strings.Contains(out, "systemd is not running here") {
		t.Errorf("dpkg -i without systemd does not say it starts nothing:\n%s", out)
	}
	for f, mode := range expectedFiles(t) {
		st, err := os.Stat(f)
		if err != nil {
			t.Errorf("installed file: %v", err)
		} else if st.Mode().Perm() != mode {
			t.Errorf("%s mode %v, want %v", f, st.Mode().Perm(), mode)
		}
	}
	if v := run(t, "/usr/bin/mgpu-cli", "version"); !strings.Contains(v, v1) {
		t.Errorf("mgpu-cli version %q, want %s", v, v1)
	}
	if c := run(t, "dpkg-query", "-W", "-f", "${Conffiles}", "mgpu"); !strings.Contains(c, "/etc/mgpu/config.toml") {
		t.Errorf("conffiles %q lack /etc/mgpu/config.toml", c)
	}
	// The units verify as installed (their ExecStart binaries exist now).
	verifyUnits(t, "/usr/lib/systemd/system/mgpu-enforcer@.service", "/usr/lib/systemd/system/mgpu-enforcers.service",
		"/usr/lib/systemd/system/mgpu-cdi-refresh.service", "/usr/lib/systemd/system/mgpu-cdi-refresh.path",
		"/usr/lib/systemd/system/mgpu-device-plugin.service", "/usr/lib/systemd/system/mgpu-metrics.service")
	// The preset enabled the units offline (symlinks for the next boot),
	// all but the device plugin and the exporter.
	enabled := []string{"mgpu-enforcers.service", "mgpu-cdi-refresh.service", "mgpu-cdi-refresh.path"}
	for _, u := range enabled {
		if !exists("/etc/systemd/system/multi-user.target.wants/" + u) {
			t.Errorf("%s not enabled by the install", u)
		}
	}
	for _, u := range []string{"mgpu-device-plugin.service", "mgpu-metrics.service"} {
		if exists("/etc/systemd/system/multi-user.target.wants/" + u) {
			t.Errorf("%s enabled by the install, want it disabled (the preset)", u)
		}
	}

	// The operator makes it a simulated one-GPU node. The state directory
	// is the default /var/lib/mgpu; the run directory and the CDI spec go
	// to the test's scratch space (each fake-systemd call has its own /run).
	cfg := fmt.Sprintf(`# edited by the packaging test
version = 1
backend = "sim"
run_dir = %q
cdi_spec_dir = %q

[[sim.gpu]]
name = "Simulated-GPU-16GB"
memory_mib = 16384
`, n.runDir, filepath.Join(tmp, "cdi"))
	if err := os.WriteFile("/etc/mgpu/config.toml", []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := filepath.Join(tmp, "cdi", cdi.SpecFileName(config.DefaultCDIKind, cdi.FormatYAML))

	// 2. Remove: binaries and units go, the edited configuration stays.
	run(t, "dpkg", "-r", "mgpu")
	for _, f := range []string{"/usr/bin/mgpu-cli", "/usr/bin/kubectl-inspect-mgpu", "/usr/bin/mgpu-enforcer", "/usr/bin/mgpu-hook", "/usr/bin/mgpu-device-plugin",
		"/usr/lib/mgpu/libmgpu-shim.so", "/usr/lib/systemd/system/mgpu-enforcer@.service", "/usr/lib/systemd/system/mgpu-cdi-refresh.path",
		"/usr/lib/systemd/system/mgpu-device-plugin.service", "/usr/lib/systemd/system/mgpu-metrics.service"} {
		if exists(f) {
			t.Errorf("%s is still there after dpkg -r", f)
		}
	}
	for _, u := range enabled {
		if exists("/etc/systemd/system/multi-user.target.wants/" + u) {
			t.Errorf("%s still enabled after dpkg -r", u)
		}
	}
	if got, _ := os.ReadFile("/etc/mgpu/config.toml"); string(got) != cfg {
		t.Errorf("/etc/mgpu/config.toml after dpkg -r: %q, want the edited one", got)
	}
	if s := dpkgStatus(t); !strings.HasPrefix(s, "rc") {
		t.Errorf("dpkg status after dpkg -r: %q, want rc (config-files)", s)
	}

	// 3. Reinstall v1 with systemd: the units are enabled again, the CDI
	// spec is written and the GPU's enforcer starts.
	n.calls()
	n.mustFakeSystemd("dpkg", "-i", debFile(dist, v1))
	calls := n.calls()
	t.Logf("reinstall: systemctl calls %q", calls)
	for _, c := range []string{"preset " + strings.Join(enabled, " ") + " mgpu-device-plugin.service mgpu-metrics.service", "restart mgpu-cdi-refresh.service", "restart mgpu-enforcers.service"} {
		if !slices.Contains(calls, c) {
			t.Errorf("reinstall: no systemctl %s; calls: %q", c, calls)
		}
	}
	for _, u := range []string{"mgpu-device-plugin.service", "mgpu-metrics.service"} {
		if exists(filepath.Join(n.state, "enabled", u)) {
			t.Errorf("reinstall: the preset enabled %s", u)
		}
	}
	noPluginStart(t, "reinstall", calls)
	if got, _ := os.ReadFile("/etc/mgpu/config.toml"); string(got) != cfg {
		t.Errorf("/etc/mgpu/config.toml after the reinstall: %q, want the edited one", got)
	}
	if !exists(spec) {
		t.Errorf("reinstall: no CDI spec %s", spec)
	}
	sleeper := exec.Command("sleep", "600")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sleeper.Process.Kill(); _ = sleeper.Wait() })
	oldPID := n.enforcerPID()
	in := n.create(sleeper.Process.Pid)

	// 4. Upgrade to v2 with the enforcer running: restarted, not stopped.
	out = n.mustFakeSystemd("dpkg", "-i", debFile(dist, v2))
	calls = n.calls()
	t.Logf("upgrade: systemctl calls %q", calls)
	if !slices.Contains(calls, "restart mgpu-enforcers.service") {
		t.Errorf("upgrade: enforcers not restarted; calls: %q", calls)
	}
	for _, u := range []string{"mgpu-device-plugin.service", "mgpu-metrics.service"} {
		if !slices.Contains(calls, "try-restart "+u) {
			t.Errorf("upgrade: no systemctl try-restart %s (a running one keeps the old binary); calls: %q", u, calls)
		}
	}
	noPluginStart(t, "upgrade", calls)
	for _, c := range calls {
		if strings.HasPrefix(c, "stop") || strings.HasPrefix(c, "disable") {
			t.Errorf("upgrade: systemctl %s", c)
		}
	}
	if v := run(t, "/usr/bin/mgpu-cli", "version"); !strings.Contains(v, v2) {
		t.Errorf("after the upgrade mgpu-cli version %q, want %s\n%s", v, v2, out)
	}
	newPID := n.enforcerPID()
	if newPID == oldPID || alive(oldPID) || !alive(newPID) {
		t.Errorf("upgrade: enforcer pid %d -> %d (old alive %v, new alive %v), want a restart", oldPID, newPID, alive(oldPID), alive(newPID))
	}
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", newPID)); err != nil || exe != "/usr/bin/mgpu-enforcer" {
		t.Errorf("upgrade: the enforcer runs %q (%v), want the new /usr/bin/mgpu-enforcer", exe, err)
	}
	list := n.instances()
	t.Logf("upgrade: enforcer pid %d -> %d, instances %+v", oldPID, newPID, list)
	if !slices.ContainsFunc(list, func(i instance) bool { return i.Name == in.Name }) {
		t.Errorf("upgrade lost instance %s: the restarted enforcer lists %+v\nlog: %s", in.Name, list, n.enforcerLog())
	}
	if got, _ := os.ReadFile("/etc/mgpu/config.toml"); string(got) != cfg {
		t.Errorf("/etc/mgpu/config.toml after the upgrade: %q, want the edited one", got)
	}

	// 5. Remove with systemd: units stopped and disabled, the CDI spec
	// removed, the configuration and the instance tables kept.
	n.mustFakeSystemd("dpkg", "-r", "mgpu")
	calls = n.calls()
	t.Logf("remove: systemctl calls %q", calls)
	if !slices.ContainsFunc(calls, func(c string) bool {
		f := strings.Fields(c)
		return strings.HasPrefix(c, "disable --now") && slices.Contains(f, "mgpu-device-plugin.service") && slices.Contains(f, "mgpu-metrics.service")
	}) || !slices.Contains(calls, "stop mgpu-enforcer@*.service") {
		t.Errorf("remove: units (the device plugin and the exporter among them) not stopped and disabled; calls: %q", calls)
	}
	if alive(newPID) {
		t.Errorf("remove: enforcer %d still runs", newPID)
	}
	if exists(spec) {
		t.Errorf("remove: CDI spec %s is still there", spec)
	}
	if !exists("/etc/mgpu/config.toml") || !exists("/var/lib/mgpu/gpu0") {
		t.Errorf("remove: configuration or state directory gone")
	}

	// 6. Purge: the configuration goes too (cleanup checks the rest).
	run(t, "dpkg", "--purge", "mgpu")
	if exists("/etc/mgpu") {
		t.Errorf("/etc/mgpu is still there after the purge")
	}
	if s := dpkgStatus(t); s != "" && !strings.HasPrefix(s, "un") {
		t.Errorf("dpkg status after the purge: %q", s)
	}
}

// noPluginStart fails the test if a systemctl call would start the device
// plugin (the package never does; try-restart only restarts a running one).
func noPluginStart(t *testing.T, step string, calls []string) {
	t.Helper()
	for _, c := range calls {
		f := strings.Fields(c)
		if len(f) > 1 && (f[0] == "start" || f[0] == "restart" || f[0] == "enable" || f[0] == "reload-or-restart") &&
			(slices.Contains(f[1:], "mgpu-device-plugin.service") || slices.Contains(f[1:], "mgpu-metrics.service")) {
			t.Errorf("%s: systemctl %s: the package must not start the device plugin or the exporter", step, c)
		}
	}
}

// machineFree skips the test unless this machine has no mgpu package and
// none of its files: the install tests install onto it and purge at the end.
func machineFree(t *testing.T) {
	t.Helper()
	if s := dpkgStatus(t); s != "" && !strings.HasPrefix(s, "un") {
		t.Skipf("an mgpu package is known to dpkg here (%s); not touching it", s)
	}
	for _, p := range packagePaths {
		if exists(p) {
			t.Skipf("%s exists: this machine has mgpu files the test would overwrite or purge", p)
		}
	}
}

// TestContainerE2EFromPackage installs the .deb and runs the container
// suite (test/e2e) on it: the enforcer, the CLI, the hook the CDI spec runs
// and the shim it mounts are the package's, under /usr; the build directory
// the suite sees holds only the test fixtures (the simulated driver,
// fakecuda-ctl, mgpu-workload), so nothing of mgpu can come from the build
// tree. The tests that build their own binaries from the source tree skip
// themselves in this mode.
func TestContainerE2EFromPackage(t *testing.T) {
	needRoot(t)
	needTools(t, "dpkg", "dpkg-query", "go")
	machineFree(t)
	root := repoRoot(t)
	fixtures := installWithFixtures(t, root)
	out, err := goTestOnPackage(t, root, fixtures, "test/e2e", nil, "-p", "1", "./test/e2e")
	if err != nil {
		t.Fatalf("test/e2e on the installed package: %v\n%s", err, out)
	}
	for _, want := range []string{"--- PASS: TestShares", "--- PASS: TestAdmissionRefused", "--- PASS: TestExecJoinsInstance", "--- PASS: TestEnforcerRestart"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("test/e2e on the installed package: no %q (skipped?)", strings.TrimPrefix(want, "--- PASS: "))
		}
	}
}

// TestChartFromPackage installs the .deb and runs test/k8s's
// TestChartInstall/package on it: a node with the package (its enforcers,
// CLI, hook and shim, under /usr) and the Helm chart in package mode,
// which runs the node agent and the webhook from the image on the
// cluster; the seed's Deployment, helm upgrade and helm uninstall as there.
// The build directory the cluster's node sees holds only the test fixtures.
func TestChartFromPackage(t *testing.T) {
	needRoot(t)
	needTools(t, "dpkg", "dpkg-query", "go")
	machineFree(t)
	root := repoRoot(t)
	fixtures := installWithFixtures(t, root)
	out, err := goTestOnPackage(t, root, fixtures, "test/k8s TestChartInstall/package", func(l string) bool {
		return strings.Contains(l, "chart_test.go") || strings.Contains(l, "both busy") || strings.Contains(l, "beside an idle")
	}, "-run", "^TestChartInstall$/^package$", "./test/k8s")
	if err != nil {
		t.Fatalf("test/k8s on the installed package: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "--- SKIP: TestChartInstall") {
		t.Skip("test/k8s skipped TestChartInstall (no cluster binaries: make deps)")
	}
	if !strings.Contains(string(out), "--- PASS: TestChartInstall/package") {
		t.Errorf("test/k8s on the installed package: no TestChartInstall/package")
	}
}

// goTestOnPackage runs `go test -count=1 -v -timeout 20m args...` in the
// repository on the installed package (MGPU_E2E_INSTALLED=/usr, MGPU_BUILD
// the fixtures), logs its results (and the lines keep selects) under what,
// and returns its output.
func goTestOnPackage(t *testing.T, root, fixtures, what string, keep func(line string) bool, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command("go", append([]string{"test", "-count=1", "-v", "-timeout", "20m"}, args...)...) //nolint:gosec // the repository's tests
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "MGPU_E2E_INSTALLED=/usr", "MGPU_BUILD="+fixtures)
	out, err := cmd.CombinedOutput()
	var summary []string
	for _, l := range strings.Split(string(out), "\n") {
		l = strings.TrimSpace(l)
		if strings.HasPrefix(l, "--- ") || strings.HasPrefix(l, "ok ") || strings.HasPrefix(l, "FAIL") || (keep != nil && keep(l)) {
			summary = append(summary, l)
		}
	}
	t.Logf("%s on the installed package (MGPU_E2E_INSTALLED=/usr):\n%s", what, strings.Join(summary, "\n"))
	return out, err
}

// installWithFixtures installs the v2 .deb on this machine (purged when
// the test ends) and returns a build directory holding only the test
// fixtures (the simulated driver, fakecuda-ctl, mgpu-workload), for the
// suites that run on the installed package (MGPU_BUILD), so that nothing
// of mgpu can come from the build tree.
func installWithFixtures(t *testing.T, root string) string {
	t.Helper()
	fixtures := filepath.Join(t.TempDir(), "build")
	for _, f := range []string{"bin/fakecuda-ctl", "bin/mgpu-workload", "fakecuda/libcuda.so.1", "fakecuda/libnvidia-ml.so.1"} {
		data, err := os.ReadFile(filepath.Join(root, "build", f))
		if err != nil {
			t.Skipf("the test fixtures are not built (make build): %v", err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(fixtures, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(fixtures, f), data, 0o755); err != nil { //nolint:gosec // executables and libraries
			t.Fatal(err)
		}
	}
	dist := packages(t)
	t.Cleanup(func() {
		if out, err := exec.Command("dpkg", "--purge", "mgpu").CombinedOutput(); err != nil {
			t.Errorf("cleanup: dpkg --purge mgpu: %v\n%s", err, out)
		}
		for _, p := range packagePaths {
			if exists(p) {
				t.Errorf("cleanup: %s is left after the purge", p)
			}
		}
	})
	run(t, "dpkg", "-i", debFile(dist, v2))
	return fixtures
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// booted is a Debian 12 tree running systemd as its PID 1 under
// systemd-nspawn (its own pid, mount, uts and ipc namespaces, the host's
// network and kernel).
type booted struct {
	t    *testing.T
	root string // the tree on the host
	init int    // its systemd, as a host pid
}

// newTree extracts the cached Debian 12 tree with systemd (scripts/deps.sh
// builds it); boot starts it.
func newTree(t *testing.T) *booted {
	t.Helper()
	needRoot(t)
	tar := filepath.Join(envOr("CACHE_DIR", "/var/cache/mgpu"), "systemd-rootfs-bookworm.tar")
	for _, tool := range []string{"systemd-nspawn", "nsenter", "tar", "chroot"} {
		if _, err := exec.LookPath(tool); err != nil {
			needCI(t, "%s is not installed (scripts/deps.sh)", tool)
		}
	}
	if st, err := os.Stat(tar); err != nil || !st.Mode().IsRegular() {
		needCI(t, "no Debian tree with systemd at %s (a tarball: scripts/deps.sh builds it with mmdebstrap): %v", tar, err)
	}
	b := &booted{t: t, root: t.TempDir()}
	run(t, "tar", "-C", b.root, "-xf", tar)
	return b
}

// chroot runs a command in the tree, not booted (an image build).
func (b *booted) chroot(args ...string) string {
	b.t.Helper()
	out, err := exec.Command("chroot", append([]string{b.root}, args...)...).CombinedOutput()
	if err != nil {
		b.t.Fatalf("chroot %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// boot starts the tree's systemd under systemd-nspawn and waits until the
// system is up; it is powered off when the test ends.
func (b *booted) boot() {
	t := b.t
	t.Helper()
	name := fmt.Sprintf("mgpu-pkg-%d", os.Getpid())
	var log bytes.Buffer
	nspawn := exec.Command("systemd-nspawn", "--quiet", "-D", b.root, "--boot", "--register=no", "--keep-unit", "-M", name)
	nspawn.Stdout, nspawn.Stderr = &log, &log
	if err := nspawn.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = nspawn.Wait(); close(exited) }()
	t.Cleanup(func() {
		// SIGTERM asks nspawn for an orderly shutdown of the booted system.
		_ = nspawn.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			t.Errorf("systemd-nspawn did not shut the tree down in 30 s; killing it\n%s", log.String())
			if b.init > 0 {
				_ = syscall.Kill(b.init, syscall.SIGKILL)
			}
			_ = nspawn.Process.Kill()
			<-exited
		}
	})
	// The tree's systemd is nspawn's child; wait until it has booted.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if b.init == 0 {
			if kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", nspawn.Process.Pid, nspawn.Process.Pid)); err == nil {
				if f := strings.Fields(string(kids)); len(f) > 0 {
					b.init, _ = strconv.Atoi(f[0])
				}
			}
		}
		if b.init > 0 {
			out, _ := b.exec("systemctl", "is-system-running")
			if s := strings.TrimSpace(out); s == "running" || s == "degraded" {
				break
			}
		}
		select {
		case <-exited:
			t.Fatalf("systemd-nspawn exited while booting:\n%s", log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the tree did not boot in 60 s:\n%s", log.String())
		}
		time.Sleep(100 * time.Millisecond) // boot poll, bounded by the deadline
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// needCI skips, or fails where CI must provide what is missing.
func needCI(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatalf("CI must provide this: "+format, args...)
	}
	t.Skipf(format, args...)
}

// exec runs a command in the booted tree (all its namespaces).
func (b *booted) exec(args ...string) (string, error) {
	out, err := exec.Command("nsenter", append([]string{"-t", strconv.Itoa(b.init), "-a"}, args...)...).CombinedOutput()
	return string(out), err
}

func (b *booted) must(args ...string) string {
	b.t.Helper()
	out, err := b.exec(args...)
	if err != nil {
		b.t.Fatalf("%s (in the booted tree): %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// mainPID is a unit's main pid in the tree (0: not running).
func (b *booted) mainPID(unit string) int {
	b.t.Helper()
	out := b.must("systemctl", "show", "-p", "MainPID", "--value", unit)
	pid, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		b.t.Fatalf("systemctl show %s: %q", unit, out)
	}
	return pid
}

// TestNodeImageUnderSystemd follows a node image's life with a real
// systemd: packaging/node-image/install.sh installs v1 into a Debian 12
// tree that is not running (an image build, chroot) and whose
// /etc/mgpu/config.toml the image already carries (kept, no prompt); the
// tree then boots (systemd-nspawn) and the units start the hardened
// enforcer of its simulated GPU and write the CDI spec on their own; a
// process-tree instance is made with `mgpu-cli run`; the kubelet device
// plugin, left disabled by the install, is enabled and started by hand and
// stays up without a kubelet; upgrading to v2 with dpkg restarts the
// enforcer and the plugin with the new binaries, and the enforcer restores
// the instance; removing the package stops the units, the plugin included,
// and leaves the configuration.
func TestNodeImageUnderSystemd(t *testing.T) {
	needTools(t, "dpkg-deb")
	b := newTree(t)
	dist := packages(t)
	for _, v := range []string{v1, v2} {
		data, err := os.ReadFile(debFile(dist, v))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(b.root, "root", filepath.Base(debFile(dist, v))), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	script, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging", "node-image", "install.sh"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b.root, "root", "install.sh"), script, 0o755); err != nil { //nolint:gosec // a script
		t.Fatal(err)
	}
	// The image's own configuration: a simulated one-GPU node.
	cfg := "# the packaging test's node\nversion = 1\nbackend = \"sim\"\n\n[[sim.gpu]]\nname = \"Simulated-GPU-16GB\"\nmemory_mib = 16384\n"
	if err := os.MkdirAll(filepath.Join(b.root, "etc", "mgpu"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b.root, "etc", "mgpu", "config.toml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}

	// 1. The image build: install.sh in the tree, systemd not running.
	out := b.chroot("/root/install.sh", "--package", "/root/"+filepath.Base(debFile(dist, v1)), "--runtime", "containerd")
	t.Logf("install.sh (image build):\n%s", out)
	if !strings.Contains(out, "the units start on the node's first boot") {
		t.Errorf("install.sh in an image build does not say the units start at first boot")
	}
	if !exists(filepath.Join(b.root, "etc", "containerd", "conf.d", "mgpu.toml")) {
		t.Errorf("install.sh --runtime containerd wrote no /etc/containerd/conf.d/mgpu.toml")
	}
	if got, _ := os.ReadFile(filepath.Join(b.root, "etc", "mgpu", "config.toml")); string(got) != cfg {
		t.Errorf("/etc/mgpu/config.toml after install.sh: %q, want the image's", got)
	}

	// 2. First boot: the units start the enforcer and write the spec.
	b.boot()
	var oldPID int
	if err := pollFor(20*time.Second, func() bool { oldPID = b.mainPID("mgpu-enforcer@0.service"); return oldPID > 0 }); err != nil {
		st, _ := b.exec("systemctl", "--no-pager", "status", "mgpu-*")
		t.Fatalf("no mgpu-enforcer@0 running after the first boot:\n%s", st)
	}
	for _, u := range []string{"mgpu-enforcers.service", "mgpu-cdi-refresh.path"} {
		if s, _ := b.exec("systemctl", "is-enabled", u); strings.TrimSpace(s) != "enabled" {
			t.Errorf("%s is %q after the install, want enabled", u, strings.TrimSpace(s))
		}
	}
	// /run is the booted system's tmpfs: look from inside.
	spec := "/var/run/cdi/" + cdi.SpecFileName(config.DefaultCDIKind, cdi.FormatYAML)
	if err := pollFor(10*time.Second, func() bool { _, err := b.exec("test", "-s", spec); return err == nil }); err != nil {
		t.Errorf("no CDI spec %s in the booted system", spec)
	}
	if info, err := b.exec("mgpu-cli", "device", "info", "-a"); err != nil || !strings.Contains(info, "compute_policy") {
		t.Errorf("mgpu-cli device info -a on the booted node: %v\n%s", err, info)
	}

	// The device plugin: installed, not enabled, not started.
	const plugin = "mgpu-device-plugin.service"
	if s, _ := b.exec("systemctl", "is-enabled", plugin); strings.TrimSpace(s) != "disabled" {
		t.Errorf("%s is %q after the install and first boot, want disabled (the preset)", plugin, strings.TrimSpace(s))
	}
	if pid := b.mainPID(plugin); pid != 0 {
		t.Errorf("%s runs (pid %d) though nobody enabled it", plugin, pid)
	}
	// An operator turns it on before the node has joined: it waits for the
	// kubelet's kubeconfig, active. Once that is there (its API server does
	// not answer: there is none here) and with no kubelet either, the plugin
	// serves its socket, tries to register again and again, and stays active.
	b.must("systemctl", "enable", "--now", plugin)
	pluginSock := filepath.Join(b.root, "var", "lib", "kubelet", "device-plugins", "mgpu-core.sock")
	var journal string
	if err := pollFor(10*time.Second, func() bool {
		journal, _ = b.exec("journalctl", "--no-pager", "-o", "cat", "-u", plugin)
		return strings.Contains(journal, "waiting for the kubeconfig")
	}); err != nil {
		st, _ := b.exec("systemctl", "--no-pager", "status", plugin)
		t.Fatalf("%s does not wait for /etc/kubernetes/kubelet.conf:\n%s\njournal:\n%s", plugin, st, journal)
	}
	if show := b.must("systemctl", "show", "-p", "ActiveState", plugin); !strings.Contains(show, "ActiveState=active\n") {
		t.Errorf("%s waiting for its kubeconfig: %s", plugin, show)
	}
	b.must("sh", "-c", `mkdir -p /etc/kubernetes && cat >/etc/kubernetes/kubelet.conf <<'EOF'
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
EOF`)
	if err := pollFor(10*time.Second, func() bool {
		journal, _ = b.exec("journalctl", "--no-pager", "-o", "cat", "-u", plugin)
		return strings.Count(journal, "not registered with the kubelet; trying again") >= 3
	}); err != nil {
		st, _ := b.exec("systemctl", "--no-pager", "status", plugin)
		t.Fatalf("%s does not keep trying to register without a kubelet:\n%s\njournal:\n%s", plugin, st, journal)
	}
	show := b.must("systemctl", "show", "-p", "ActiveState,SubState,NRestarts", plugin)
	if !strings.Contains(show, "ActiveState=active\n") || !strings.Contains(show, "SubState=running\n") || !strings.Contains(show, "NRestarts=0\n") {
		t.Errorf("%s without a kubelet:\n%s\njournal:\n%s", plugin, show, journal)
	}
	if st, err := os.Stat(pluginSock); err != nil || st.Mode().Type() != os.ModeSocket {
		t.Errorf("the plugin's socket %s: %v (mode %v)", pluginSock, err, st)
	}
	// Its first poll reached mgpu-enforcer@0's control socket through the
	// unit's sandbox: a GPU whose enforcer does not answer is logged.
	if !strings.Contains(journal, "serving") || strings.Contains(journal, "GPU unhealthy") {
		t.Errorf("%s did not see GPU 0's enforcer:\n%s", plugin, journal)
	}
	pluginPID := b.mainPID(plugin)
	t.Logf("%s without a kubelet, pid %d:\n%s\n%s", plugin, pluginPID, show, journal)

	// 3. An instance: a process tree that lives through the upgrade.
	b.must("sh", "-c", "setsid mgpu-cli run --device 0 --core 30 --memory 1024 -- sleep 600 >/tmp/run.log 2>&1 </dev/null &")
	var before string
	if err := pollFor(10*time.Second, func() bool {
		before, _ = b.exec("mgpu-cli", "instance", "list")
		return strings.Contains(before, "mgpu0inst")
	}); err != nil {
		log, _ := b.exec("cat", "/tmp/run.log")
		t.Fatalf("no instance after mgpu-cli run:\n%s\n%s", before, log)
	}
	name := strings.Fields(before[strings.Index(before, "mgpu0inst"):])[0]

	// 4. Upgrade to v2 with dpkg, the enforcer running.
	out = b.must("dpkg", "--force-confold", "-i", "/root/"+filepath.Base(debFile(dist, v2)))
	t.Logf("dpkg -i %s:\n%s", v2, out)
	var newPID int
	if err := pollFor(20*time.Second, func() bool {
		newPID = b.mainPID("mgpu-enforcer@0.service")
		return newPID > 0 && newPID != oldPID
	}); err != nil {
		t.Fatalf("the enforcer was not restarted by the upgrade (main pid %d before, %d after)", oldPID, newPID)
	}
	if v := b.must("mgpu-cli", "version"); !strings.Contains(v, v2) {
		t.Errorf("after the upgrade: %q, want %s", v, v2)
	}
	if exe := b.must("readlink", fmt.Sprintf("/proc/%d/exe", newPID)); strings.TrimSpace(exe) != "/usr/bin/mgpu-enforcer" {
		t.Errorf("the restarted enforcer runs %q, want /usr/bin/mgpu-enforcer", strings.TrimSpace(exe))
	}
	var after string
	if err := pollFor(10*time.Second, func() bool {
		after, _ = b.exec("mgpu-cli", "instance", "list")
		return strings.Contains(after, name)
	}); err != nil {
		j, _ := b.exec("journalctl", "--no-pager", "-u", "mgpu-enforcer@0")
		t.Fatalf("the upgrade lost instance %s:\n%s\njournal:\n%s", name, after, j)
	}
	t.Logf("upgrade %s -> %s: enforcer pid %d -> %d; instances:\n%s", v1, v2, oldPID, newPID, after)
	var newPluginPID int
	if err := pollFor(10*time.Second, func() bool {
		newPluginPID = b.mainPID(plugin)
		return newPluginPID > 0 && newPluginPID != pluginPID
	}); err != nil {
		t.Errorf("the upgrade did not restart %s (main pid %d before, %d after)", plugin, pluginPID, newPluginPID)
	} else if exe := b.must("readlink", fmt.Sprintf("/proc/%d/exe", newPluginPID)); strings.TrimSpace(exe) != "/usr/bin/mgpu-device-plugin" {
		t.Errorf("the restarted plugin runs %q, want /usr/bin/mgpu-device-plugin", strings.TrimSpace(exe))
	}
	if got, _ := os.ReadFile(filepath.Join(b.root, "etc", "mgpu", "config.toml")); string(got) != cfg {
		t.Errorf("/etc/mgpu/config.toml after the upgrade: %q, want the node's", got)
	}

	// 5. Remove: the enforcer stops, the units are disabled, the
	// configuration stays.
	b.must("dpkg", "-r", "mgpu")
	if s, _ := b.exec("systemctl", "is-active", "mgpu-enforcer@0.service"); strings.TrimSpace(s) == "active" {
		t.Errorf("mgpu-enforcer@0 still active after dpkg -r")
	}
	// Stopped cleanly (SIGTERM: exit status 0), not failed.
	if s, _ := b.exec("systemctl", "is-active", plugin); strings.TrimSpace(s) != "inactive" {
		t.Errorf("%s is %q after dpkg -r, want inactive", plugin, strings.TrimSpace(s))
	}
	if exists(filepath.Join(b.root, "etc", "systemd", "system", "multi-user.target.wants", plugin)) {
		t.Errorf("%s still enabled after dpkg -r", plugin)
	}
	if exists(pluginSock) {
		t.Errorf("the plugin's socket %s is still there after dpkg -r", pluginSock)
	}
	if _, err := b.exec("test", "-e", spec); err == nil {
		t.Errorf("the CDI spec %s is still there after dpkg -r", spec)
	}
	if got, _ := os.ReadFile(filepath.Join(b.root, "etc", "mgpu", "config.toml")); string(got) != cfg {
		t.Errorf("/etc/mgpu/config.toml after dpkg -r: %q, want the node's", got)
	}
}

// pollFor polls cond every 50 ms until it holds or timeout passes.
func pollFor(timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %v", timeout)
		}
		time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline
	}
	return nil
}

// `make image` writes the same archive from two builds of one version (in
// two scratch build directories), and what containerd imports from it runs:
// every binary starts in the image (the cgo ones with the C library the
// image carries) and says the version it was built as.
func TestMakeImage(t *testing.T) {
	needTools(t, "make", "go")
	var sums [2]string
	var outs, builds [2]string
	for i := range sums {
		b := t.TempDir()
		builds[i] = b
		outs[i] = filepath.Join(b, "image.tar")
		cmd := exec.Command("make", "--no-print-directory", "image", "BUILD="+b, "VERSION="+v1, "IMAGE_OUT="+outs[i], "IMAGE_REPO=mgpu.local/test/mgpu")
		cmd.Dir = repoRoot(t)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make image: %v\n%s", err, out)
		}
		data, err := os.ReadFile(outs[i])
		if err != nil {
			t.Fatal(err)
		}
		sums[i] = fmt.Sprintf("%x", sha256.Sum256(data))
		t.Logf("build %d: %d bytes, sha256 %s", i+1, len(data), sums[i])
	}
	if sums[0] != sums[1] {
		t.Fatalf("two builds of %s gave different archives: %s and %s", v1, sums[0], sums[1])
	}
	if os.Geteuid() != 0 {
		t.Skip("running the image needs root (containerd)")
	}
	bin, err := e2e.ContainerdBinaries()
	if err != nil {
		t.Skip(err)
	}
	c, err := e2e.StartContainerd(bin, filepath.Join(t.TempDir(), "containerd"), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	if out, err := c.Ctr(ctx, 2*time.Minute, "images", "import", outs[0]); err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, out)
	}
	ref := "mgpu.local/test/mgpu:" + v1
	for i, tc := range []struct {
		args []string
		want string // in its output
		fail bool   // it exits non-zero (flag's -h)
	}{
		{[]string{"/usr/bin/mgpu-cli", "version"}, "mgpu-cli " + v1, false},
		{[]string{"/usr/bin/mgpu-enforcer", "-h"}, "Usage of mgpu-enforcer", true},
		{[]string{"/usr/bin/mgpu-hook", "--help"}, "OCI hook of mgpu", false},
		{[]string{"/usr/bin/mgpu-device-plugin", "--help"}, "mgpu's kubelet device plugin", false},
		{[]string{"/usr/bin/mgpu-webhook", "--help"}, "mutating admission webhook", false},
		{[]string{"/usr/bin/kubectl-inspect-mgpu", "--help"}, "kubectl inspect mgpu", false},
	} {
		out, err := c.Ctr(ctx, time.Minute, append([]string{"run", "--rm", ref, fmt.Sprintf("image-%d", i)}, tc.args...)...)
		if (err != nil) != tc.fail || !strings.Contains(out, tc.want) {
			t.Errorf("%s in the image: err %v, want %q in its output:\n%s", strings.Join(tc.args, " "), err, tc.want, out)
		}
	}
	t.Run("node install", func(t *testing.T) { imageNodeInstall(t, c, ref, builds[0]) })
}

// imageNodeInstall runs the chart's installer from the image, the host's
// directories bound in under /host as the chart mounts them, on a
// simulated node: the build's hook and shim land in a directory of their
// own, with the node configuration and the CDI spec naming them; node
// uninstall removes them again.
func imageNodeInstall(t *testing.T, c *e2e.Containerd, ref, build string) {
	d := t.TempDir()
	host := map[string]string{ // in the container -> here
		"/host/opt/mgpu":    filepath.Join(d, "opt"),
		"/host/etc/mgpu":    filepath.Join(d, "etc"),
		"/host/var/run/cdi": filepath.Join(d, "cdi"),
		"/etc/mgpu-chart":   filepath.Join(d, "chart"),
	}
	run := filepath.Join(d, "run")
	host[run] = run
	for _, p := range host {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sim, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging/config/sim-node.toml"))
	if err != nil {
		t.Fatal(err)
	}
	conf := fmt.Sprintf("run_dir = %q\nstate_dir = %q\ncdi_spec_dir = \"/var/run/cdi\"\n", run, filepath.Join(run, "state"))
	if err := os.WriteFile(filepath.Join(host["/etc/mgpu-chart"], "config.toml"), append([]byte(conf), sim...), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ctrRun := func(name string, args ...string) string {
		t.Helper()
		a := []string{"run", "--rm", "--privileged"}
		for in, here := range host {
			a = append(a, "--mount", "type=bind,src="+here+",dst="+in+",options=rbind:rw")
		}
		a = append(append(a, ref, name, "/usr/bin/mgpu-cli", "--config", "/etc/mgpu-chart/config.toml", "node"), args...)
		out, err := c.Ctr(ctx, time.Minute, a...)
		if err != nil {
			t.Fatalf("node %s in the image: %v\n%s", args[0], err, out)
		}
		return out
	}
	out := ctrRun("install", "install", "--host-root", "/host", "--install-dir", "/opt/mgpu")
	ents, err := os.ReadDir(host["/host/opt/mgpu"])
	if err != nil || len(ents) != 1 {
		t.Fatalf("/opt/mgpu after node install: %v (%v)\n%s", ents, err, out)
	}
	dir := "/opt/mgpu/" + ents[0].Name()
	if !strings.HasPrefix(ents[0].Name(), v1+"-") {
		t.Errorf("the build's directory %s is not named after version %s", dir, v1)
	}
	for rel, src := range map[string]string{"bin/mgpu-hook": "bin/mgpu-hook", "lib/mgpu/libmgpu-shim.so": "lib/libmgpu-shim.so"} {
		got, err1 := os.ReadFile(filepath.Join(host["/host/opt/mgpu"], ents[0].Name(), rel))
		want, err2 := os.ReadFile(filepath.Join(build, src))
		if err1 != nil || err2 != nil || !bytes.Equal(got, want) {
			t.Errorf("%s/%s is not the image's %s (%v, %v)", dir, rel, src, err1, err2)
		}
	}
	cfg, err := os.ReadFile(filepath.Join(host["/host/etc/mgpu"], "config.toml"))
	if err != nil || !strings.Contains(string(cfg), fmt.Sprintf("prefix = %q", dir)) {
		t.Errorf("the node configuration (%v) does not set prefix %s:\n%s", err, dir, cfg)
	}
	spec, err := os.ReadFile(filepath.Join(host["/host/var/run/cdi"], "mgpu.io-gpu.yaml"))
	if err != nil || !strings.Contains(string(spec), dir+"/bin/mgpu-hook") || !strings.Contains(string(spec), dir+"/lib/mgpu/libmgpu-shim.so") {
		t.Errorf("the CDI spec (%v) does not name the installed hook and shim:\n%s", err, spec)
	}
	out = ctrRun("uninstall", "uninstall", "--host-root", "/host", "--install-dir", "/opt/mgpu")
	for _, p := range []string{filepath.Join(host["/host/etc/mgpu"], "config.toml"), filepath.Join(host["/host/var/run/cdi"], "mgpu.io-gpu.yaml"), filepath.Join(host["/host/opt/mgpu"], ents[0].Name())} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("node uninstall left %s (%v):\n%s", p, err, out)
		}
	}
}
