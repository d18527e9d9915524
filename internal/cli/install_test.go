package cli

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/cdi"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// installEnv is a host root, an image's files to install and a node
// configuration (the shipped simulated node, its run directory a real
// temporary one, its CDI spec directory the host's /var/run/cdi).
type installEnv struct {
	host, source, config string
}

func newInstallEnv(t *testing.T) *installEnv {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the simulated GPUs' device nodes need root (mknod)")
	}
	d := t.TempDir()
	e := &installEnv{host: filepath.Join(d, "host"), source: filepath.Join(d, "image", "usr"), config: filepath.Join(d, "chart.toml")}
	e.build(t, "hook v1", "shim v1")
	sim, err := os.ReadFile(simNodeFile)
	if err != nil {
		t.Fatal(err)
	}
	head := fmt.Sprintf("run_dir = %q\nstate_dir = %q\ncdi_spec_dir = \"/var/run/cdi\"\n", filepath.Join(d, "run"), filepath.Join(d, "state"))
	if err := os.WriteFile(e.config, append([]byte(head), sim...), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

// build puts another build's hook and shim into the image.
func (e *installEnv) build(t *testing.T, hook, shim string) {
	t.Helper()
	for p, data := range map[string]string{"bin/mgpu-hook": hook, "lib/mgpu/libmgpu-shim.so": shim} {
		p = filepath.Join(e.source, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func (e *installEnv) run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	return run(t, append([]string{"--config", e.config, "node", args[0], "--host-root", e.host}, args[1:]...)...)
}

func (e *installEnv) install(t *testing.T) string {
	t.Helper()
	out, stderr, code := e.run(t, "install", "--source-prefix", e.source)
	if code != 0 {
		t.Fatalf("node install: status %d: %s%s", code, out, stderr)
	}
	return out
}

// versions lists the directories under the host's /opt/mgpu.
func (e *installEnv) versions(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(e.host, "opt", "mgpu"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var v []string
	for _, x := range ents {
		v = append(v, x.Name())
	}
	return v
}

// A first install writes one build's directory (hook, shim, the preload
// file naming that shim), the node configuration with its prefix set to
// it, and the CDI spec of the configuration's GPUs naming that hook, shim
// and configuration; installing the same build again changes nothing.
func TestNodeInstall(t *testing.T) {
	e := newInstallEnv(t)
	e.install(t)
	vs := e.versions(t)
	if len(vs) != 1 {
		t.Fatalf("versions %v, want one", vs)
	}
	dir := filepath.Join("/opt/mgpu", vs[0])
	for rel, want := range map[string]string{
		"bin/mgpu-hook":            "hook v1",
		"lib/mgpu/libmgpu-shim.so": "shim v1",
		"lib/mgpu/ld.so.preload":   dir + "/lib/mgpu/libmgpu-shim.so\n",
	} {
		got, err := os.ReadFile(filepath.Join(e.host, dir, rel))
		if err != nil || string(got) != want {
			t.Errorf("%s: %q (%v), want %q", rel, got, err, want)
		}
	}
	if st, err := os.Stat(filepath.Join(e.host, dir, "bin/mgpu-hook")); err != nil || st.Mode().Perm() != 0o755 {
		t.Errorf("the hook's mode: %v (%v), want 0755", st.Mode(), err)
	}
	data, err := os.ReadFile(filepath.Join(e.host, "etc/mgpu/config.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(data), installedMarker) {
		t.Errorf("the configuration does not start with the installer's line:\n%s", data)
	}
	cfg, err := config.Parse("installed", data)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Prefix != dir || cfg.Backend != config.BackendSim {
		t.Errorf("installed configuration: prefix %q backend %q, want %q sim", cfg.Prefix, cfg.Backend, dir)
	}
	spec, err := os.ReadFile(filepath.Join(e.host, "var/run/cdi", cdi.SpecFileName(cfg.CDIKind, cdi.FormatYAML)))
	if err != nil {
		t.Fatal(err)
	}
	if err := cdi.Validate(spec, cdi.FormatYAML); err != nil {
		t.Errorf("the CDI spec: %v", err)
	}
	// (The hook reads /etc/mgpu/config.toml unless the spec names another.)
	for _, want := range []string{dir + "/bin/mgpu-hook", dir + "/lib/mgpu/libmgpu-shim.so", dir + "/lib/mgpu/ld.so.preload"} {
		if !strings.Contains(string(spec), want) {
			t.Errorf("the CDI spec does not name %s:\n%s", want, spec)
		}
	}
	e.install(t)
	if v := e.versions(t); len(v) != 1 || v[0] != vs[0] {
		t.Errorf("installing the same build again: versions %v, want %v", v, vs)
	}
}

// An upgrade adds the new build's directory and removes an old one no
// process maps the shim of; one whose shim a process maps stays (named,
// with the pid) until that process is gone; uninstall then removes the
// spec, the configuration and every directory.
func TestNodeInstallUpgradeAndUninstall(t *testing.T) {
	e := newInstallEnv(t)
	e.install(t)
	v1 := e.versions(t)
	e.build(t, "hook v2", "shim v2")
	out := e.install(t)
	v2 := e.versions(t)
	if len(v2) != 1 || v2[0] == v1[0] || !strings.Contains(out, "removed /opt/mgpu/"+v1[0]) {
		t.Fatalf("after the upgrade: versions %v (before %v), output:\n%s", v2, v1, out)
	}
	// This process maps the second build's shim, as a container's would.
	f, err := os.Open(filepath.Join(e.host, "opt/mgpu", v2[0], "lib/mgpu/libmgpu-shim.so"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, 7, unix.PROT_READ, unix.MAP_SHARED)
	_ = f.Close()
	if err != nil {
		t.Fatal(err)
	}
	mapped := true
	defer func() {
		if mapped {
			_ = unix.Munmap(m)
		}
	}()
	e.build(t, "hook v3", "shim v3")
	out = e.install(t)
	v3 := e.versions(t)
	if len(v3) != 2 || !strings.Contains(out, fmt.Sprintf("kept /opt/mgpu/%s: its shim is mapped by 1 process(es) (pid %d)", v2[0], os.Getpid())) {
		t.Fatalf("with the second build's shim mapped: versions %v, output:\n%s", v3, out)
	}
	out, stderr, code := e.run(t, "uninstall")
	if code != 0 || !strings.Contains(out, "kept /opt/mgpu/"+v2[0]) {
		t.Fatalf("uninstall with a shim mapped: status %d, output:\n%s%s", code, out, stderr)
	}
	if v := e.versions(t); len(v) != 1 || v[0] != v2[0] {
		t.Errorf("uninstall with a shim mapped: versions %v, want only %s", v, v2[0])
	}
	for _, p := range []string{"etc/mgpu/config.toml", "var/run/cdi/mgpu.io-gpu.yaml"} {
		if _, err := os.Stat(filepath.Join(e.host, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("uninstall left %s (%v)", p, err)
		}
	}
	_ = unix.Munmap(m)
	mapped = false
	if out, stderr, code := e.run(t, "uninstall"); code != 0 {
		t.Fatalf("uninstall: status %d: %s%s", code, out, stderr)
	}
	if _, err := os.Stat(filepath.Join(e.host, "opt/mgpu")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("uninstall left /opt/mgpu (%v): %v", err, e.versions(t))
	}
}

// A configuration the installer did not write is never removed, nor its
// spec; --unless-daemonset removes nothing while the DaemonSet is there,
// or when that cannot be told.
func TestNodeUninstallKeeps(t *testing.T) {
	e := newInstallEnv(t)
	e.install(t)
	old := daemonSetGone
	defer func() { daemonSetGone = old }()
	for _, tc := range []struct {
		gone bool
		err  error
		code int
		want string
	}{
		{false, nil, 0, "the DaemonSet kube-system/mgpu-node is still there"},
		{false, errors.New("connection refused"), 1, "is the DaemonSet kube-system/mgpu-node still there: connection refused; nothing removed"},
	} {
		daemonSetGone = func(_ context.Context, _, ns, name string) (bool, error) {
			if ns != "kube-system" || name != "mgpu-node" {
				t.Errorf("asked about %s/%s", ns, name)
			}
			return tc.gone, tc.err
		}
		out, stderr, code := e.run(t, "uninstall", "--unless-daemonset", "kube-system/mgpu-node")
		if code != tc.code || !strings.Contains(out+stderr, tc.want) {
			t.Errorf("status %d, output %q %q; want %d and %q", code, out, stderr, tc.code, tc.want)
		}
		if len(e.versions(t)) != 1 {
			t.Errorf("files removed: %v", e.versions(t))
		}
	}
	daemonSetGone = func(context.Context, string, string, string) (bool, error) { return true, nil }
	cfgPath := filepath.Join(e.host, "etc/mgpu/config.toml")
	if err := os.WriteFile(cfgPath, []byte("version = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, stderr, code := e.run(t, "uninstall", "--unless-daemonset", "kube-system/mgpu-node")
	if code != 0 || !strings.Contains(out, "kept /etc/mgpu/config.toml: node install did not write it") {
		t.Fatalf("status %d: %s%s", code, out, stderr)
	}
	if _, err := os.Stat(cfgPath); err != nil {
		t.Errorf("the operator's configuration was removed: %v", err)
	}
	if len(e.versions(t)) != 0 {
		t.Errorf("versions left: %v", e.versions(t))
	}
}

// Bad input gets one line and changes nothing on the host.
func TestNodeInstallRefuses(t *testing.T) {
	e := newInstallEnv(t)
	if err := os.WriteFile(e.config, []byte("version = 1\nbackend = \"gpu\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"install", "--source-prefix", e.source},
		{"install", "--source-prefix", e.source, "--install-dir", "opt/mgpu"},
		{"uninstall", "--unless-daemonset", "mgpu-node"},
	} {
		out, stderr, code := e.run(t, args...)
		if code == 0 || strings.Count(strings.TrimSpace(stderr), "\n") != 0 || !strings.HasPrefix(stderr, "mgpu: ") {
			t.Errorf("%v: status %d, stdout %q, stderr %q: want one line and a failure", args, code, out, stderr)
		}
	}
	if _, err := os.Stat(e.host); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the host was written: %v", err)
	}
}

func TestParseMapsID(t *testing.T) {
	t.Parallel()
	for line, want := range map[string]fileID{
		"7f1c2a400000-7f1c2a401000 r--p 00000000 fd:01 1835012                    /opt/mgpu/x/lib/mgpu/libmgpu-shim.so": {0xfd, 1, 1835012},
		"7ffd1c9b2000-7ffd1c9d3000 rw-p 00000000 00:00 0                          [stack]":                              {},
		"55d0 r-xp 00000000 103:02 42 /usr/bin/x (deleted)":                                                             {0x103, 2, 42},
		"short line": {},
	} {
		got, ok := parseMapsID(line)
		if ok != (want != fileID{}) || got != want {
			t.Errorf("%q: %+v %v, want %+v", line, got, ok, want)
		}
	}
}

// The supervisor runs one enforcer per GPU index with the configuration,
// starts one that exits again, and stops them all with SIGTERM when its
// context ends.
func TestSupervise(t *testing.T) {
	t.Parallel()
	d := t.TempDir()
	log := filepath.Join(d, "starts")
	script := filepath.Join(d, "enforcer")
	// Device 1 exits at once the first time; device 0 runs until SIGTERM.
	body := fmt.Sprintf(`#!/bin/sh
echo "$*" >> %q
if [ "$2" = 1 ] && [ ! -e %q ]; then touch %q; exit 3; fi
trap 'echo "stopped $2" >> %q; exit 0' TERM
while :; do sleep 0.05; done
`, log, filepath.Join(d, "once"), filepath.Join(d, "once"), log)
	if err := os.WriteFile(script, []byte(body), 0o700); err != nil { //nolint:gosec // a test program
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var out strings.Builder
	go func() {
		supervise(ctx, script, "/etc/mgpu/config.toml", []int{0, 1}, 5*time.Second, &strings.Builder{}, &strings.Builder{}, &out)
		close(done)
	}()
	lines := func() string { b, _ := os.ReadFile(log); return string(b) }
	deadline := time.Now().Add(10 * time.Second)
	for strings.Count(lines(), "--device 1 --config /etc/mgpu/config.toml") < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("device 1 was not started again after it exited:\n%s", lines())
		}
		time.Sleep(20 * time.Millisecond) // polling the script's log
	}
	cancel()
	<-done
	got := lines()
	if strings.Count(got, "--device 0 --config /etc/mgpu/config.toml") != 1 || !strings.Contains(got, "stopped 0") || !strings.Contains(got, "stopped 1") {
		t.Errorf("starts and stops:\n%s", got)
	}
}

// What the API server answers about the DaemonSet: there (not being
// deleted), being deleted, gone; a token no longer accepted or allowed
// (the release's ServiceAccount and Role deleted with it) counts as gone;
// a server error does not.
func TestDaemonSetGone(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status int
		body   string
		gone   bool
		err    bool
	}{
		{200, `{"apiVersion":"apps/v1","kind":"DaemonSet","metadata":{"name":"mgpu-node","namespace":"kube-system"}}`, false, false},
		{200, `{"apiVersion":"apps/v1","kind":"DaemonSet","metadata":{"name":"mgpu-node","namespace":"kube-system","deletionTimestamp":"2026-12-06T00:00:00Z"}}`, true, false},
		{404, `{"apiVersion":"v1","kind":"Status","status":"Failure","reason":"NotFound","code":404}`, true, false},
		{401, `{"apiVersion":"v1","kind":"Status","status":"Failure","reason":"Unauthorized","code":401}`, true, false},
		{403, `{"apiVersion":"v1","kind":"Status","status":"Failure","reason":"Forbidden","code":403}`, true, false},
		{500, `{"apiVersion":"v1","kind":"Status","status":"Failure","reason":"InternalError","code":500}`, false, true},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/apis/apps/v1/namespaces/kube-system/daemonsets/mgpu-node" {
				t.Errorf("asked for %s", r.URL.Path)
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			_, _ = w.Write([]byte(tc.body))
		}))
		kc := filepath.Join(t.TempDir(), "kubeconfig")
		conf := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: %s\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: t\n", srv.URL)
		if err := os.WriteFile(kc, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		gone, err := daemonSetGone(ctx, kc, "kube-system", "mgpu-node")
		cancel()
		srv.Close()
		if gone != tc.gone || (err != nil) != tc.err {
			t.Errorf("HTTP %d: gone %v err %v, want gone %v err %v", tc.status, gone, err, tc.gone, tc.err)
		}
	}
}
