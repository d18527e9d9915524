// Package ociimage writes a container image of one layer as an OCI image
// layout in a tar archive (what `ctr images import`, `podman load` and
// `skopeo copy oci-archive:` read), with no registry and no container
// daemon. The same inputs give the same bytes: files belong to root,
// modification times are the epoch, entries are sorted, and the layer's
// gzip stream carries no time or name. The manifests, the configuration
// and the layout are go-containerregistry's.
package ociimage

import (
	"archive/tar"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/mgpu-dev/mgpu/internal/version"
)

// Entry is one path of the image's layer: a regular file copied from Src,
// a symbolic link to Link, or (neither set) a directory. Parent
// directories are added as needed (mode 0755).
type Entry struct {
	Path string      // absolute, in the image
	Src  string      // a regular file: the host file it copies
	Link string      // a symbolic link: its target
	Mode fs.FileMode // permission bits; 0: 0644 for files, 0755 for directories
}

// Config is the runtime part of the image's configuration.
type Config struct {
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	User       string
	Labels     map[string]string
}

// Image is what Write writes.
type Image struct {
	// Ref names the image (registry/name:tag): containerd imports it under
	// this name; the layout's ref.name annotation is its tag.
	Ref     string
	Arch    string // GOARCH-style: amd64, arm64
	Entries []Entry
	Config  Config
	// Created is the image's creation time (default: the epoch, so that
	// the same inputs give the same digest).
	Created time.Time
}

// epoch is every entry's modification time.
var epoch = time.Unix(0, 0).UTC()

// Write writes img to out (replaced atomically) and returns the digest of
// its manifest.
func Write(out string, img Image) (v1.Hash, error) {
	tag, err := tagOf(img.Ref)
	if err != nil {
		return v1.Hash{}, err
	}
	if img.Arch == "" {
		return v1.Hash{}, errors.New("ociimage: no architecture")
	}
	work, err := os.MkdirTemp(filepath.Dir(out), ".ociimage-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer func() { _ = os.RemoveAll(work) }()
	l, err := writeLayer(filepath.Join(work, "layer.tar.gz"), img.Entries)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("ociimage: the layer of %s: %w", img.Ref, err)
	}
	i := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	i = mutate.ConfigMediaType(i, types.OCIConfigJSON)
	created := img.Created
	if created.IsZero() {
		created = epoch
	}
	if i, err = mutate.Append(i, mutate.Addendum{Layer: l, MediaType: types.OCILayer,
		History: v1.History{Created: v1.Time{Time: created}, CreatedBy: "mgpu ociimage", Comment: img.Ref}}); err != nil {
		return v1.Hash{}, err
	}
	cf, err := i.ConfigFile()
	if err != nil {
		return v1.Hash{}, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = img.Arch, "linux"
	cf.Created = v1.Time{Time: created}
	cf.Config = v1.Config{Entrypoint: img.Config.Entrypoint, Cmd: img.Config.Cmd, Env: img.Config.Env,
		WorkingDir: img.Config.WorkingDir, User: img.Config.User, Labels: img.Config.Labels}
	if i, err = mutate.ConfigFile(i, cf); err != nil {
		return v1.Hash{}, err
	}
	digest, err := i.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	dir := filepath.Join(work, "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendImage(i,
		layout.WithPlatform(v1.Platform{OS: "linux", Architecture: img.Arch}),
		layout.WithAnnotations(map[string]string{
			"io.containerd.image.name":          img.Ref,
			"org.opencontainers.image.ref.name": tag,
		})); err != nil {
		return v1.Hash{}, err
	}
	tmp := filepath.Join(work, "image.tar")
	if err := tarTree(tmp, dir); err != nil {
		return v1.Hash{}, err
	}
	if err := os.Rename(tmp, out); err != nil {
		return v1.Hash{}, err
	}
	return digest, nil
}

// tagOf returns ref's tag: what follows the last ':' after the last '/'.
func tagOf(ref string) (string, error) {
	name, tag, ok := strings.Cut(ref[strings.LastIndex(ref, "/")+1:], ":")
	if !ok || name == "" || !validTag(tag) {
		return "", fmt.Errorf("ociimage: image reference %q: want registry/name:tag, the tag of letters, digits, '_', '.' and '-' (at most 128, not starting with '.' or '-')", ref)
	}
	return tag, nil
}

func validTag(t string) bool {
	if t == "" || len(t) > 128 || t[0] == '.' || t[0] == '-' {
		return false
	}
	for _, c := range t {
		if !tagChar(c) {
			return false
		}
	}
	return true
}

// tagChar: letters, digits, '_', '.' and '-'.
func tagChar(c rune) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-'
}

// Tag turns a version into a valid tag (version.Slug, at most 128
// characters): a package version 1.2.3+git4.abc1234 is the tag
// 1.2.3-git4.abc1234.
func Tag(v string) string {
	t := version.Slug(v)
	if len(t) > 128 {
		t = t[:128]
	}
	return t
}

// writeLayer writes the entries as a gzipped tar to out, hashing the tar
// (the diff ID) and the gzip stream (the digest) on the way.
func writeLayer(out string, entries []Entry) (v1.Layer, error) {
	es, err := normalise(entries)
	if err != nil {
		return nil, err
	}
	f, err := os.Create(out) //nolint:gosec // our work directory
	if err != nil {
		return nil, err
	}
	zh := sha256.New()
	zc := &counter{w: io.MultiWriter(f, zh)}
	zw, err := gzip.NewWriterLevel(zc, gzip.DefaultCompression)
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	th := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(zw, th))
	err = writeEntries(tw, es)
	if err == nil {
		err = tw.Close()
	}
	if err == nil {
		err = zw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	return &fileLayer{path: out, digest: hashOf(zh), diffID: hashOf(th), size: zc.n}, nil
}

// normalise checks the entries, adds their missing parent directories and
// sorts them by path.
func normalise(entries []Entry) ([]Entry, error) {
	byPath := map[string]Entry{}
	for _, e := range entries {
		p := path.Clean(e.Path)
		if !path.IsAbs(e.Path) || p == "/" {
			return nil, fmt.Errorf("entry %q: want an absolute path below /", e.Path)
		}
		if e.Src != "" && e.Link != "" {
			return nil, fmt.Errorf("entry %s: both a file and a link", p)
		}
		if prev, ok := byPath[p]; ok && prev != e {
			return nil, fmt.Errorf("entry %s: given twice, differently", p)
		}
		e.Path = p
		byPath[p] = e
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if prev, ok := byPath[d]; ok {
				if prev.Src != "" || prev.Link != "" {
					return nil, fmt.Errorf("entry %s: its parent %s is not a directory", p, d)
				}
				continue
			}
			byPath[d] = Entry{Path: d}
		}
	}
	out := make([]Entry, 0, len(byPath))
	for _, e := range byPath {
		out = append(out, e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

func writeEntries(tw *tar.Writer, es []Entry) error {
	for _, e := range es {
		hdr := &tar.Header{Name: strings.TrimPrefix(e.Path, "/"), ModTime: epoch, Format: tar.FormatPAX}
		mode := e.Mode.Perm() | e.Mode&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)
		switch {
		case e.Link != "":
			hdr.Typeflag, hdr.Linkname, hdr.Mode = tar.TypeSymlink, e.Link, 0o777
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
		case e.Src != "":
			if mode == 0 {
				mode = 0o644
			}
			if err := writeFile(tw, hdr, e.Src, mode); err != nil {
				return err
			}
		default:
			if mode == 0 {
				mode = 0o755
			}
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, hdr.Name+"/", tarMode(mode)
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
		}
	}
	return nil
}

func writeFile(tw *tar.Writer, hdr *tar.Header, src string, mode fs.FileMode) error {
	f, err := os.Open(src) //nolint:gosec // the caller's file
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s: not a regular file", src)
	}
	hdr.Typeflag, hdr.Size, hdr.Mode = tar.TypeReg, st.Size(), tarMode(mode)
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	n, err := io.Copy(tw, f)
	if err == nil && n != st.Size() {
		err = fmt.Errorf("%s changed while it was read", src)
	}
	return err
}

func tarMode(m fs.FileMode) int64 {
	v := int64(m.Perm())
	if m&fs.ModeSetuid != 0 {
		v |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		v |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		v |= 0o1000
	}
	return v
}

// tarTree writes the directory tree dir (an image layout) as a tar file.
func tarTree(out, dir string) error {
	f, err := os.Create(out) //nolint:gosec // our work directory
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		name := filepath.ToSlash(rel)
		if d.IsDir() {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX})
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s: not a regular file in an image layout", p)
		}
		return writeFile(tw, &tar.Header{Name: name, ModTime: epoch, Format: tar.FormatPAX}, p, 0o644)
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func hashOf(h hash.Hash) v1.Hash {
	return v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}
}

type counter struct {
	w io.Writer
	n int64
}

func (c *counter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// fileLayer is a gzipped layer in a file, its digests known.
type fileLayer struct {
	path           string
	digest, diffID v1.Hash
	size           int64
}

func (l *fileLayer) Digest() (v1.Hash, error) { return l.digest, nil }
func (l *fileLayer) DiffID() (v1.Hash, error) { return l.diffID, nil }
func (l *fileLayer) Size() (int64, error)     { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error) {
	return types.OCILayer, nil
}

func (l *fileLayer) Compressed() (io.ReadCloser, error) {
	return os.Open(l.path)
}

func (l *fileLayer) Uncompressed() (io.ReadCloser, error) {
	f, err := os.Open(l.path)
	if err != nil {
		return nil, err
	}
	z, err := gzip.NewReader(f)
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	return &zipReader{z: z, f: f}, nil
}

type zipReader struct {
	z *gzip.Reader
	f *os.File
}

func (r *zipReader) Read(p []byte) (int, error) { return r.z.Read(p) }
func (r *zipReader) Close() error {
	err := r.z.Close()
	if cerr := r.f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Tree returns the entries of a root filesystem on the host, dir as the
// image's /: its directories, regular files and symbolic links with their
// permission bits (setuid, setgid and sticky kept); other kinds (devices,
// sockets, fifos) are not in an image and are skipped.
func Tree(dir string) ([]Entry, error) {
	var es []Entry
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		e := Entry{Path: "/" + filepath.ToSlash(rel), Mode: info.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)}
		switch {
		case info.IsDir():
		case info.Mode()&fs.ModeSymlink != 0:
			if e.Link, err = os.Readlink(p); err != nil {
				return err
			}
		case info.Mode().IsRegular():
			e.Src = p
		default:
			return nil
		}
		es = append(es, e)
		return nil
	})
	return es, err
}
