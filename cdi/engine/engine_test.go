package engine

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"
)

var specDirs = []string{"/etc/cdi", "/var/run/cdi"}

// mainConfig is a containerd 2.x config with comments and settings the
// edit must keep.
const mainConfig = `# containerd main configuration (managed by hand)
version = 3   # config version
root = "/var/lib/containerd"

# keep me: a comment before a table
[grpc]
  address = "/run/containerd/containerd.sock"  # trailing comment

[plugins."io.containerd.cri.v1.runtime"]
  max_container_log_line_size = 9999
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
    SystemdCgroup = true
`

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o640); err != nil {
		t.Fatal(err)
	}
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func decodeTOML(t *testing.T, data string) map[string]any {
	t.Helper()
	var m map[string]any
	if _, err := toml.Decode(data, &m); err != nil {
		t.Fatalf("invalid TOML: %v\n%s", err, data)
	}
	return m
}

func importsOf(t *testing.T, data string) []string {
	t.Helper()
	var out []string
	list, _ := decodeTOML(t, data)["imports"].([]any)
	for _, v := range list {
		out = append(out, v.(string))
	}
	return out
}

func TestContainerdAddsImportKeepingEverythingElse(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	main, dropIn := filepath.Join(dir, "config.toml"), filepath.Join(dir, "conf.d", "mgpu.toml")
	write(t, main, mainConfig)
	plan, err := Containerd(ContainerdOptions{Config: main, DropIn: dropIn, SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	if !plan.Changed() {
		t.Fatal("the first run plans no change")
	}
	if err := plan.Apply(); err != nil {
		t.Fatal(err)
	}
	got := read(t, main)
	want := strings.Replace(mainConfig, "version = 3   # config version\n", "version = 3   # config version\nimports = [\""+dropIn+"\"]\n", 1)
	if got != want {
		t.Errorf("main config:\n%s\nwant exactly the original plus the import:\n%s", got, want)
	}
	if st, _ := os.Stat(main); st.Mode().Perm() != 0o640 {
		t.Errorf("main config mode %o, want the original 0640", st.Mode().Perm())
	}
	d := decodeTOML(t, read(t, dropIn))
	if d["version"] != int64(3) {
		t.Errorf("drop-in version = %v, want 3", d["version"])
	}
	rt := d["plugins"].(map[string]any)["io.containerd.cri.v1.runtime"].(map[string]any)
	if dirs := rt["cdi_spec_dirs"].([]any); len(dirs) != 2 || dirs[0] != "/etc/cdi" || dirs[1] != "/var/run/cdi" {
		t.Errorf("cdi_spec_dirs = %v", dirs)
	}
	if st, _ := os.Stat(dropIn); st.Mode().Perm() != 0o644 {
		t.Errorf("drop-in mode %o, want 0644", st.Mode().Perm())
	}

	// Second run: nothing to do.
	plan, err = Containerd(ContainerdOptions{Config: main, DropIn: dropIn, SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	if plan.Changed() {
		for _, c := range plan {
			t.Errorf("second run changes %s (%v):\n%s", c.Path, c.Changed(), c.New)
		}
	}
}

func TestContainerdImportsEdits(t *testing.T) {
	t.Parallel()
	const p = "/etc/containerd/conf.d/mgpu.toml"
	for _, tc := range []struct {
		name, in, want string
	}{
		{
			name: "one line",
			in:   "version = 3\nimports = [\"/etc/a.toml\"] # others\n",
			want: "version = 3\nimports = [\"/etc/a.toml\", \"" + p + "\"] # others\n",
		},
		{
			name: "empty",
			in:   "version = 3\nimports = []\n",
			want: "version = 3\nimports = [\"" + p + "\"]\n",
		},
		{
			name: "literal strings",
			in:   "version = 2\nimports = ['/etc/a,]#.toml']\n",
			want: "version = 2\nimports = ['/etc/a,]#.toml', \"" + p + "\"]\n",
		},
		{
			name: "multi-line, trailing comma, comments",
			in:   "version = 3\nimports = [\n  \"/etc/a.toml\", # a\n  # b\n]\n[grpc]\n",
			want: "version = 3\nimports = [\n  \"/etc/a.toml\", # a\n  # b\n  \"" + p + "\",\n]\n[grpc]\n",
		},
		{
			name: "multi-line, no trailing comma",
			in:   "version = 3\nimports = [\n  \"/etc/a.toml\" # a\n]\n",
			want: "version = 3\nimports = [\n  \"/etc/a.toml\", # a\n  \"" + p + "\",\n]\n",
		},
		{
			name: "multi-line, bracket after value",
			in:   "version = 3\nimports = [\n  \"/etc/a.toml\"]\n",
			want: "version = 3\nimports = [\n  \"/etc/a.toml\",\n  \"" + p + "\"]\n",
		},
		{
			name: "imports after other keys and a multi-line string",
			in:   "version = 3\nx = \"\"\"\n[not a table]\nimports = []\n\"\"\"\nimports = [\"/etc/a.toml\"]\n[grpc]\n",
			want: "version = 3\nx = \"\"\"\n[not a table]\nimports = []\n\"\"\"\nimports = [\"/etc/a.toml\", \"" + p + "\"]\n[grpc]\n",
		},
		{
			name: "imports key only in a table is not the top-level one",
			in:   "version = 3\n[x]\nimports = [\"/a\"]\n",
			want: "version = 3\nimports = [\"" + p + "\"]\n[x]\nimports = [\"/a\"]\n",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			main := filepath.Join(dir, "config.toml")
			write(t, main, tc.in)
			plan, err := Containerd(ContainerdOptions{Config: main, DropIn: p, SpecDirs: specDirs})
			if err != nil {
				t.Fatal(err)
			}
			if got := string(plan[1].New); got != tc.want {
				t.Errorf("got:\n%s\nwant:\n%s", got, tc.want)
			}
			if imp := importsOf(t, string(plan[1].New)); !slices.Contains(imp, p) {
				t.Errorf("imports = %v, want %s among them", imp, p)
			}
		})
	}
}

func TestContainerdAlreadyImportedByGlob(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	main := filepath.Join(dir, "config.toml")
	in := "version = 3\nimports = [\"conf.d/*.toml\"]\n"
	write(t, main, in)
	plan, err := Containerd(ContainerdOptions{Config: main, DropIn: filepath.Join(dir, "conf.d", "mgpu.toml"), SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	if plan[1].Changed() {
		t.Errorf("a relative glob already imports the drop-in, but main changes to:\n%s", plan[1].New)
	}
}

func TestContainerdCreatesMinimalConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	main, dropIn := filepath.Join(dir, "etc", "config.toml"), filepath.Join(dir, "etc", "conf.d", "mgpu.toml")
	plan, err := Containerd(ContainerdOptions{Config: main, DropIn: dropIn, SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	if err := plan.Apply(); err != nil {
		t.Fatal(err)
	}
	if got, want := read(t, main), "version = 3\nimports = [\""+dropIn+"\"]\n"; got != want {
		t.Errorf("main = %q, want %q", got, want)
	}
}

func TestContainerdMalformed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{name: "syntax", in: "version = 3\nroot = \n[grpc]\n", want: "line 2: invalid TOML"},
		{name: "unterminated table", in: "version = 3\n[grpc\naddress = 1\n", want: "invalid TOML"},
		{name: "version 1", in: "root = \"/x\"\n", want: "config version 0 is too old"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			main, dropIn := filepath.Join(dir, "config.toml"), filepath.Join(dir, "conf.d", "mgpu.toml")
			write(t, main, tc.in)
			_, err := Containerd(ContainerdOptions{Config: main, DropIn: dropIn, SpecDirs: specDirs})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), main+": ") || strings.Contains(err.Error(), "\n") {
				t.Fatalf("err = %v, want one line naming %s and %q", err, main, tc.want)
			}
			if read(t, main) != tc.in {
				t.Error("the malformed file was changed")
			}
			if _, err := os.Stat(dropIn); !os.IsNotExist(err) {
				t.Error("a drop-in was written")
			}
		})
	}
}

func TestContainerd17CarriesTheCRISection(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	main, dropIn := filepath.Join(dir, "config.toml"), filepath.Join(dir, "conf.d", "mgpu.toml")
	write(t, main, `version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
[plugins."io.containerd.other"]
  x = 1
`)
	plan, err := Containerd(ContainerdOptions{Config: main, DropIn: dropIn, Version: Containerd17, SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	if err := plan.Apply(); err != nil {
		t.Fatal(err)
	}
	d := decodeTOML(t, read(t, dropIn))
	if d["version"] != int64(2) {
		t.Errorf("drop-in version = %v, want 2", d["version"])
	}
	plugins := d["plugins"].(map[string]any)
	cri := plugins["io.containerd.grpc.v1.cri"].(map[string]any)
	if cri["enable_cdi"] != true || cri["sandbox_image"] != "registry.k8s.io/pause:3.9" {
		t.Errorf("CRI section = %v, want the main config's plus enable_cdi", cri)
	}
	opts := cri["containerd"].(map[string]any)["runtimes"].(map[string]any)["runc"].(map[string]any)["options"].(map[string]any)
	if opts["SystemdCgroup"] != true {
		t.Errorf("runc options lost: %v", opts)
	}
	if _, ok := plugins["io.containerd.other"]; ok {
		t.Error("the drop-in carries other plugins' sections")
	}
	again, err := Containerd(ContainerdOptions{Config: main, DropIn: dropIn, Version: Containerd17, SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	if again.Changed() {
		t.Error("second 1.7 run changes files")
	}
}

func TestApplyUnwritable(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	write(t, file, "")
	plan, err := Docker(filepath.Join(file, "daemon.json"), specDirs)
	if err != nil {
		t.Fatal(err)
	}
	err = plan.Apply()
	if err == nil || !strings.HasPrefix(err.Error(), "write "+filepath.Join(file, "daemon.json")+": ") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("err = %v, want one line naming the file", err)
	}
}

func TestAddImportBeforeFirstTable(t *testing.T) {
	t.Parallel()
	in := "# only a comment\n[grpc]\n  address = \"x\"\n"
	got, err := addImport([]byte(in), "/p.toml")
	if err != nil {
		t.Fatal(err)
	}
	if want := "# only a comment\nimports = [\"/p.toml\"]\n[grpc]\n  address = \"x\"\n"; string(got) != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

const daemonJSON = `{
  "log-driver": "journald",
  "features": {"buildkit": true},
  "registry-mirrors": ["https://mirror.example"],
  "cdi-spec-dirs": ["/opt/cdi"]
}
`

func TestDocker(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "daemon.json")
	write(t, path, daemonJSON)
	plan, err := Docker(path, specDirs)
	if err != nil {
		t.Fatal(err)
	}
	if err := plan.Apply(); err != nil {
		t.Fatal(err)
	}
	got := read(t, path)
	want := `{
  "log-driver": "journald",
  "features": {
    "buildkit": true,
    "cdi": true
  },
  "registry-mirrors": [
    "https://mirror.example"
  ],
  "cdi-spec-dirs": [
    "/opt/cdi",
    "/etc/cdi",
    "/var/run/cdi"
  ]
}
`
	if got != want {
		t.Errorf("daemon.json:\n%s\nwant:\n%s", got, want)
	}
	again, err := Docker(path, specDirs)
	if err != nil {
		t.Fatal(err)
	}
	if again.Changed() {
		t.Errorf("second run changes daemon.json:\n%s", again[0].New)
	}

	// A file already configured, formatted differently, is kept byte for byte.
	compact := `{"features":{"cdi":true},"cdi-spec-dirs":["/etc/cdi","/var/run/cdi"]}`
	write(t, path, compact)
	if p, err := Docker(path, specDirs); err != nil || p.Changed() {
		t.Errorf("configured compact file: changed=%v err=%v", p.Changed(), err)
	}
}

func TestDockerNewFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "docker", "daemon.json")
	plan, err := Docker(path, specDirs)
	if err != nil {
		t.Fatal(err)
	}
	if err := plan.Apply(); err != nil {
		t.Fatal(err)
	}
	var m struct {
		Features    map[string]bool `json:"features"`
		CDISpecDirs []string        `json:"cdi-spec-dirs"`
	}
	if err := json.Unmarshal([]byte(read(t, path)), &m); err != nil {
		t.Fatal(err)
	}
	if !m.Features["cdi"] || !slices.Equal(m.CDISpecDirs, specDirs) {
		t.Errorf("daemon.json = %+v", m)
	}
}

func TestDockerMalformed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{name: "syntax", in: "{\n  \"a\": 1,\n  \"b\": }\n", want: "line 3: invalid JSON"},
		{name: "truncated", in: "{\n  \"a\": [1,\n", want: "invalid JSON"},
		{name: "not an object", in: "[1]\n", want: "want a JSON object"},
		{name: "features not an object", in: `{"features": true}`, want: `"features" must be an object`},
		{name: "dirs not strings", in: `{"cdi-spec-dirs": "/etc/cdi"}`, want: `"cdi-spec-dirs" must be a list`},
		{name: "trailing text", in: `{} {}`, want: "text after the object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "daemon.json")
			write(t, path, tc.in)
			_, err := Docker(path, specDirs)
			if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") || !strings.HasPrefix(err.Error(), path+": ") {
				t.Fatalf("err = %v, want one line naming the file and %q", err, tc.want)
			}
			if read(t, path) != tc.in {
				t.Error("the malformed file was changed")
			}
		})
	}
}

func FuzzAddImport(f *testing.F) {
	f.Add(mainConfig)
	f.Add("version = 3\nimports = [\n  \"/a\", # x\n]\n")
	f.Add("imports = ['a']\n")
	f.Fuzz(func(t *testing.T, in string) {
		var before map[string]any
		if _, err := toml.Decode(in, &before); err != nil {
			return
		}
		if _, ok := before["imports"]; ok {
			if _, isList := before["imports"].([]any); !isList {
				return
			}
		}
		const p = "/etc/containerd/conf.d/mgpu.toml"
		out, err := addImport([]byte(in), p)
		if err != nil {
			return // a refused edit is reported to the operator
		}
		var after map[string]any
		if _, err := toml.Decode(string(out), &after); err != nil {
			t.Fatalf("edit of %q produced invalid TOML %q: %v", in, out, err)
		}
		if !imported("/etc/containerd/config.toml", after, p) {
			t.Fatalf("edit of %q does not import %s: %q", in, p, out)
		}
		delete(before, "imports")
		delete(after, "imports")
		if !equalTOML(before, after) {
			t.Fatalf("edit of %q changed other settings: %q", in, out)
		}
	})
}

var update = flag.Bool("update", false, "rewrite the shipped snippets in packaging/")

// The packaged files are what the command writes on a node without engine
// configuration, so that packages and the command never disagree.
func TestShippedSnippets(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ctrd, err := Containerd(ContainerdOptions{Config: filepath.Join(dir, "config.toml"), DropIn: ContainerdDropIn, SpecDirs: specDirs})
	if err != nil {
		t.Fatal(err)
	}
	docker, err := Docker(filepath.Join(dir, "daemon.json"), specDirs)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		file string
		want []byte
	}{
		{"../../packaging/containerd/conf.d/mgpu.toml", ctrd[0].New},
		{"../../packaging/containerd/config.toml", ctrd[1].New},
		{"../../packaging/docker/daemon.json", docker[0].New},
	} {
		if *update {
			if err := os.MkdirAll(filepath.Dir(tc.file), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(tc.file, tc.want, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := os.ReadFile(tc.file)
		if err != nil {
			t.Fatalf("%v (go test ./cdi/engine -update writes it)", err)
		}
		if !bytes.Equal(got, tc.want) {
			t.Errorf("%s differs from what mgpu-cli runtime configure writes (go test ./cdi/engine -update):\n%s", tc.file, tc.want)
		}
	}
}
