package cli

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// engineEnv is an install environment plus an engine's files and a restart
// command that counts its runs.
type engineEnv struct {
	*installEnv
	dir, restarts string
}

func newEngineEnv(t *testing.T) *engineEnv {
	e := &engineEnv{installEnv: newInstallEnv(t), dir: t.TempDir()}
	e.restarts = filepath.Join(e.dir, "restarts")
	script := filepath.Join(e.dir, "restart.sh")
	if err := os.WriteFile(script, []byte("echo restarted >> "+e.restarts+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *engineEnv) restartArgs() []string {
	return []string{"--engine-restart", "/bin/sh " + filepath.Join(e.dir, "restart.sh")}
}

func (e *engineEnv) runOK(t *testing.T, args ...string) string {
	t.Helper()
	out, stderr, code := e.run(t, args...)
	if code != 0 {
		t.Fatalf("node %s: status %d: %s%s", args[0], code, out, stderr)
	}
	return out
}

func (e *engineEnv) nRestarts(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile(e.restarts)
	if os.IsNotExist(err) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(data), "restarted\n")
}

func readOr(t *testing.T, p string) string {
	t.Helper()
	data, err := os.ReadFile(p)
	if os.IsNotExist(err) {
		return "<absent>"
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// node install --engine configures the engine, records what its files held
// and restarts it once; installing again changes and restarts nothing;
// node uninstall puts every file back byte for byte and restarts it again.
func TestNodeInstallEngine(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files map[string]string // the engine's files before, relative to the test's directory ("": absent)
		args  func(dir string) []string
		check string // in the configured main file
	}{
		{"docker", map[string]string{"daemon.json": "{\n  \"log-level\": \"warn\"\n}\n"},
			func(d string) []string {
				return []string{"--engine", "docker", "--engine-config", filepath.Join(d, "daemon.json")}
			}, `"cdi": true`},
		{"docker-new", map[string]string{"daemon.json": ""},
			func(d string) []string {
				return []string{"--engine", "docker", "--engine-config", filepath.Join(d, "daemon.json")}
			}, `"cdi-spec-dirs"`},
		{"containerd-1.7", map[string]string{"config.toml": "version = 2\n# the operator's\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"pause:3.9\"\n", "conf.d/mgpu.toml": ""},
			func(d string) []string {
				return []string{"--engine", "containerd", "--containerd-version", "1.7", "--engine-config", filepath.Join(d, "config.toml"),
					"--containerd-drop-in", filepath.Join(d, "conf.d", "mgpu.toml")}
			}, "imports"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngineEnv(t)
			before := map[string]string{}
			for name, content := range tc.files {
				p := filepath.Join(e.dir, name)
				if content != "" {
					if err := os.WriteFile(p, []byte(content), 0o640); err != nil {
						t.Fatal(err)
					}
				}
				before[p] = readOr(t, p)
			}
			args := append(append([]string{"install", "--source-prefix", e.source}, tc.args(e.dir)...), e.restartArgs()...)
			out := e.runOK(t, args...)
			var main string
			for p := range before {
				if !strings.Contains(p, "conf.d") {
					main = p
				}
			}
			if got := readOr(t, main); !strings.Contains(got, tc.check) {
				t.Fatalf("%s after install: %q\n%s", main, got, out)
			}
			if n := e.nRestarts(t); n != 1 {
				t.Fatalf("restarts after install: %d, want 1\n%s", n, out)
			}
			rec := filepath.Join(e.host, "opt", "mgpu", engineRecordName)
			var r engineRecord
			if data, err := os.ReadFile(rec); err != nil || json.Unmarshal(data, &r) != nil || r.RestartPending || len(r.Files) != len(before) {
				t.Fatalf("record %s: %+v, %v", rec, r, err)
			}
			configured := map[string]string{}
			for p := range before {
				configured[p] = readOr(t, p)
			}
			// Again (a pod replaced by a rolling update): nothing changes.
			out = e.runOK(t, args...)
			for p := range before {
				if got := readOr(t, p); got != configured[p] {
					t.Errorf("%s changed by a second install: %q", p, got)
				}
			}
			if n := e.nRestarts(t); n != 1 {
				t.Errorf("restarts after a second install: %d, want 1\n%s", n, out)
			}
			out = e.runOK(t, append([]string{"uninstall"}, e.restartArgs()...)...)
			for p, want := range before {
				if got := readOr(t, p); got != want {
					t.Errorf("%s after uninstall: %q, want %q as before install\n%s", p, got, want, out)
				}
				if st, err := os.Stat(p); err == nil && want != "<absent>" && st.Mode().Perm() != 0o640 {
					t.Errorf("%s mode %v after uninstall, want 0640", p, st.Mode().Perm())
				}
			}
			if n := e.nRestarts(t); n != 2 {
				t.Errorf("restarts after uninstall: %d, want 2\n%s", n, out)
			}
			if _, err := os.Stat(rec); !os.IsNotExist(err) {
				t.Errorf("the record is left: %v", err)
			}
		})
	}
}

// A file changed since node install configured it is kept by uninstall;
// turning the step off (install without --engine) puts the others back;
// a failed restart is tried again by the next run.
func TestNodeInstallEngineKeepsAndRetries(t *testing.T) {
	e := newEngineEnv(t)
	daemon := filepath.Join(e.dir, "daemon.json")
	if err := os.WriteFile(daemon, []byte("{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	install := []string{"install", "--source-prefix", e.source, "--engine", "docker", "--engine-config", daemon}
	// The restart fails: the install fails and says so; the files are
	// configured and recorded, the restart pending.
	out, stderr, code := e.run(t, append(install, "--engine-restart", "/bin/false")...)
	if code == 0 || !strings.Contains(stderr, "tried again") {
		t.Fatalf("a failing restart: status %d: %s%s", code, out, stderr)
	}
	e.runOK(t, append(install, e.restartArgs()...)...)
	if n := e.nRestarts(t); n != 1 {
		t.Fatalf("the pending restart was not tried again: %d restarts", n)
	}
	// Turned off: the file is put back.
	e.runOK(t, append([]string{"install", "--source-prefix", e.source}, e.restartArgs()...)...)
	if got := readOr(t, daemon); got != "{}\n" || e.nRestarts(t) != 2 {
		t.Fatalf("turned off: %s holds %q, %d restarts", daemon, got, e.nRestarts(t))
	}
	// Uninstall whose restart fails: the file is back, the restart is
	// tried again by the next uninstall, which has nothing more to put
	// back (and keeps nothing).
	e.runOK(t, append(install, e.restartArgs()...)...)
	if _, stderr, code := e.run(t, "uninstall", "--engine-restart", "/bin/false"); code == 0 || !strings.Contains(stderr, "tried again") {
		t.Fatalf("uninstall with a failing restart: status %d: %s", code, stderr)
	}
	if got := readOr(t, daemon); got != "{}\n" {
		t.Fatalf("after an uninstall whose restart failed: %s holds %q", daemon, got)
	}
	n := e.nRestarts(t)
	out = e.runOK(t, append([]string{"uninstall"}, e.restartArgs()...)...)
	if e.nRestarts(t) != n+1 || strings.Contains(out, "kept") || readOr(t, daemon) != "{}\n" {
		t.Fatalf("the retried uninstall: %d restarts (was %d), %s holds %q:\n%s", e.nRestarts(t), n, daemon, readOr(t, daemon), out)
	}
	// Changed by the operator after install: kept, and named.
	e.runOK(t, append(install, e.restartArgs()...)...)
	if err := os.WriteFile(daemon, []byte("{\"features\": {\"cdi\": true}, \"debug\": true}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out = e.runOK(t, "uninstall")
	if got := readOr(t, daemon); !strings.Contains(got, "debug") || !strings.Contains(out, "kept "+daemon) {
		t.Fatalf("a file changed since install: %q\n%s", got, out)
	}
	// Bad flags change nothing.
	if _, stderr, code := e.run(t, "install", "--source-prefix", e.source, "--engine", "crio"); code == 0 || !strings.Contains(stderr, "unknown --engine") {
		t.Errorf("--engine crio: status %d: %s", code, stderr)
	}
}
