package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// archive is an OCI archive read back: its files by name.
type archive map[string][]byte

func readArchive(t *testing.T, p string) archive {
	t.Helper()
	f, err := os.Open(p) //nolint:gosec // the test's file
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	a := archive{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return a
		}
		if err != nil {
			t.Fatal(err)
		}
		if !h.ModTime.Equal(time.Unix(0, 0)) || h.Uid != 0 || h.Gid != 0 {
			t.Errorf("%s: mtime %v uid %d gid %d, want the epoch and root", h.Name, h.ModTime, h.Uid, h.Gid)
		}
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			a[h.Name] = b
		}
	}
}

func (a archive) blob(t *testing.T, digest string) []byte {
	t.Helper()
	b, ok := a["blobs/sha256/"+strings.TrimPrefix(digest, "sha256:")]
	if !ok {
		t.Fatalf("no blob %s", digest)
	}
	if sum := sha256.Sum256(b); "sha256:"+hex.EncodeToString(sum[:]) != digest {
		t.Fatalf("blob %s does not hash to its name", digest)
	}
	return b
}

type desc struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations"`
	Platform    struct {
		OS           string `json:"os"`
		Architecture string `json:"architecture"`
	} `json:"platform"`
}

func testImage(t *testing.T, dir string) Image {
	t.Helper()
	bin := filepath.Join(dir, "tool")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho tool\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "conf")
	if err := os.WriteFile(conf, []byte("x = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return Image{Ref: "example.org/team/app:1.2.3-git4.abc", Arch: "amd64",
		Entries: []Entry{
			{Path: "/usr/bin/tool", Src: bin, Mode: 0o755},
			{Path: "/etc/app/conf", Src: conf},
			{Path: "/usr/sbin/tool", Link: "../bin/tool"},
			{Path: "/tmp", Mode: 0o777 | os.ModeSticky},
		},
		Config: Config{Cmd: []string{"/usr/bin/tool"}, Env: []string{"PATH=/usr/bin"}, Labels: map[string]string{"a": "b"}}}
}

// The archive is an OCI layout whose index names the image for containerd
// and skopeo, whose blobs hash to their names, and whose one layer holds
// the entries (parents added, sorted, root's, the epoch) with the modes
// asked for; the configuration carries the runtime settings and the
// layer's diff ID.
func TestWriteLayout(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := testImage(t, dir)
	out := filepath.Join(dir, "img.tar")
	d, err := Write(out, img)
	if err != nil {
		t.Fatal(err)
	}
	a := readArchive(t, out)
	var lay struct{ ImageLayoutVersion string }
	if err := json.Unmarshal(a["oci-layout"], &lay); err != nil || lay.ImageLayoutVersion != "1.0.0" {
		t.Errorf("oci-layout %q", a["oci-layout"])
	}
	var index struct{ Manifests []desc }
	if err := json.Unmarshal(a["index.json"], &index); err != nil {
		t.Fatal(err)
	}
	if len(index.Manifests) != 1 {
		t.Fatalf("index: %d manifests, want 1", len(index.Manifests))
	}
	m := index.Manifests[0]
	if m.Digest != d.String() || m.Annotations["io.containerd.image.name"] != img.Ref ||
		m.Annotations["org.opencontainers.image.ref.name"] != "1.2.3-git4.abc" ||
		m.Platform.OS != "linux" || m.Platform.Architecture != "amd64" {
		t.Errorf("index entry %+v (Write returned %s)", m, d)
	}
	var manifest struct {
		MediaType string `json:"mediaType"`
		Config    desc   `json:"config"`
		Layers    []desc `json:"layers"`
	}
	if err := json.Unmarshal(a.blob(t, m.Digest), &manifest); err != nil {
		t.Fatal(err)
	}
	if manifest.MediaType != "application/vnd.oci.image.manifest.v1+json" || len(manifest.Layers) != 1 ||
		manifest.Layers[0].MediaType != "application/vnd.oci.image.layer.v1.tar+gzip" {
		t.Fatalf("manifest %+v", manifest)
	}
	layer := a.blob(t, manifest.Layers[0].Digest)
	if int64(len(layer)) != manifest.Layers[0].Size {
		t.Errorf("layer size %d, manifest says %d", len(layer), manifest.Layers[0].Size)
	}
	zr, err := gzip.NewReader(bytes.NewReader(layer))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if !h.ModTime.Equal(time.Unix(0, 0)) || h.Uid != 0 {
			t.Errorf("layer %s: mtime %v uid %d", h.Name, h.ModTime, h.Uid)
		}
		e := h.Name
		switch h.Typeflag {
		case tar.TypeDir:
			e += " dir " + strings.TrimLeft(h.FileInfo().Mode().String(), "d")
		case tar.TypeSymlink:
			e += " -> " + h.Linkname
		case tar.TypeReg:
			b, _ := io.ReadAll(tr)
			e += " " + h.FileInfo().Mode().String() + " " + string(bytes.TrimSpace(b))
		}
		got = append(got, e)
	}
	want := []string{
		"etc/ dir rwxr-xr-x", "etc/app/ dir rwxr-xr-x", "etc/app/conf -rw-r--r-- x = 1",
		"tmp/ dir trwxrwxrwx", "usr/ dir rwxr-xr-x", "usr/bin/ dir rwxr-xr-x",
		"usr/bin/tool -rwxr-xr-x #!/bin/sh\necho tool", "usr/sbin/ dir rwxr-xr-x", "usr/sbin/tool -> ../bin/tool",
	}
	if !slices.Equal(got, want) {
		t.Errorf("layer:\n got %q\nwant %q", got, want)
	}
	var cfg struct {
		Architecture, OS string
		Created          time.Time
		Config           struct {
			Cmd, Env []string
			Labels   map[string]string
		}
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(a.blob(t, manifest.Config.Digest), &cfg); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(raw)
	if cfg.Architecture != "amd64" || cfg.OS != "linux" || !cfg.Created.Equal(time.Unix(0, 0)) ||
		!slices.Equal(cfg.Config.Cmd, img.Config.Cmd) || !slices.Equal(cfg.Config.Env, img.Config.Env) ||
		cfg.Config.Labels["a"] != "b" || !slices.Equal(cfg.RootFS.DiffIDs, []string{"sha256:" + hex.EncodeToString(sum[:])}) {
		t.Errorf("config %+v", cfg)
	}
}

// The same inputs give the same archive, byte for byte; another file's
// content another digest.
func TestWriteDeterministic(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := testImage(t, dir)
	var sums []string
	var digests []string
	for i, out := range []string{filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")} {
		if i == 1 {
			slices.Reverse(img.Entries) // the order given does not matter
		}
		d, err := Write(out, img)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out) //nolint:gosec // the test's file
		if err != nil {
			t.Fatal(err)
		}
		s := sha256.Sum256(b)
		sums = append(sums, hex.EncodeToString(s[:]))
		digests = append(digests, d.String())
	}
	if sums[0] != sums[1] || digests[0] != digests[1] {
		t.Fatalf("two writes differ: archives %v, manifests %v", sums, digests)
	}
	if err := os.WriteFile(img.Entries[len(img.Entries)-1].Src, []byte("#!/bin/sh\necho other\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d, err := Write(filepath.Join(dir, "c.tar"), img)
	if err != nil {
		t.Fatal(err)
	}
	if d.String() == digests[0] {
		t.Fatal("another file's content gave the same digest")
	}
}

func TestWriteRefuses(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	base := testImage(t, dir)
	for name, mod := range map[string]func(*Image){
		"no tag":             func(i *Image) { i.Ref = "example.org/app" },
		"tag with a plus":    func(i *Image) { i.Ref = "example.org/app:1.2+3" },
		"port, no tag":       func(i *Image) { i.Ref = "localhost:5000/app" },
		"no architecture":    func(i *Image) { i.Arch = "" },
		"relative path":      func(i *Image) { i.Entries = append(i.Entries, Entry{Path: "usr/x"}) },
		"file and link":      func(i *Image) { i.Entries = append(i.Entries, Entry{Path: "/x", Src: "/etc/hostname", Link: "y"}) },
		"through a file":     func(i *Image) { i.Entries = append(i.Entries, Entry{Path: "/usr/bin/tool/x", Link: "y"}) },
		"twice, differently": func(i *Image) { i.Entries = append(i.Entries, Entry{Path: "/usr/bin/tool", Link: "y"}) },
		"missing source":     func(i *Image) { i.Entries = append(i.Entries, Entry{Path: "/x", Src: filepath.Join(dir, "none")}) },
	} {
		img := base
		img.Entries = slices.Clone(base.Entries)
		mod(&img)
		out := filepath.Join(dir, "refused.tar")
		if _, err := Write(out, img); err == nil {
			t.Errorf("%s: written", name)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%s: an archive was left", name)
		}
	}
}

func TestTag(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"1.2.3":                      "1.2.3",
		"1.2.3+git4.abc1234":         "1.2.3-git4.abc1234",
		"0.0.0~git291.c8f6ea8.dirty": "0.0.0-git291.c8f6ea8.dirty",
		"-x":                         "x",
	} {
		if got := Tag(in); got != want || !validTag(got) {
			t.Errorf("Tag(%q) = %q, want %q", in, got, want)
		}
	}
}

// Libraries reproduces what the loader resolves: for a dynamic executable
// of the host, its interpreter and C library, each symbolic link on the
// way (a linked /lib or /lib64 too) and the file it ends at.
func TestLibraries(t *testing.T) {
	t.Parallel()
	es, err := Libraries("/bin/true")
	if err != nil {
		t.Fatal(err)
	}
	byPath := map[string]Entry{}
	for _, e := range es {
		byPath[e.Path] = e
	}
	var files []string
	for _, e := range es {
		if e.Src != "" {
			files = append(files, filepath.Base(e.Path))
		}
	}
	if !slices.Contains(files, "libc.so.6") || !slices.ContainsFunc(files, func(f string) bool { return strings.HasPrefix(f, "ld-linux") }) {
		t.Fatalf("files %q: want libc.so.6 and the loader", files)
	}
	// Every path asked for resolves inside the entries.
	for _, want := range []string{"/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"} {
		if _, err := os.Stat(want); err != nil {
			continue // another distribution's layout
		}
		p := want
		for range 10 {
			if e, ok := byPath[p]; ok && e.Src != "" {
				break
			}
			parts := strings.Split(strings.TrimPrefix(p, "/"), "/")
			moved := false
			for i := range parts {
				pre := "/" + strings.Join(parts[:i+1], "/")
				if e, ok := byPath[pre]; ok && e.Link != "" {
					to := e.Link
					if !filepath.IsAbs(to) {
						to = filepath.Join(filepath.Dir(pre), to)
					}
					p = filepath.Join(append([]string{to}, parts[i+1:]...)...)
					moved = true
					break
				}
			}
			if !moved {
				break
			}
		}
		if e, ok := byPath[p]; !ok || e.Src == "" {
			t.Errorf("%s does not resolve to a file among the entries (ends at %s): %+v", want, p, es)
		}
	}
	// A static file has none; a non-ELF file is an error.
	sh := filepath.Join(t.TempDir(), "script")
	if err := os.WriteFile(sh, []byte("#!/bin/sh\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Libraries(sh); err == nil {
		t.Error("a script: no error")
	}
}
