package k8s

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Images of the cluster. Nothing is pulled: images are built from local
// files and imported (ImportImage); pods must say imagePullPolicy Never
// or IfNotPresent.
const (
	// PauseImage is containerd's sandbox image, built from ./pause and
	// imported by StartCluster.
	PauseImage = "registry.k8s.io/pause:3.10"
	// WorkloadImage is the suggested name of the image of e2e.BuildRootfs
	// (busybox and the simulated-GPU workload).
	WorkloadImage = "mgpu.local/workload:test"
)

// DefaultPath is the PATH of the images' configuration.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// ImageConfig is the runtime part of an image's configuration.
type ImageConfig struct {
	Entrypoint []string
	Cmd        []string
	Env        []string // default DefaultPath
	WorkingDir string   // default /
}

// BuildImageFromDir writes an image named ref (registry/name:tag) whose
// single layer is the root filesystem dir, running cmd, into a tarball
// under t.TempDir() and returns its path, for ImportImage.
func BuildImageFromDir(t testing.TB, dir, ref string, cmd []string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "image.tar")
	if err := WriteImage(out, dir, ref, ImageConfig{Cmd: cmd}); err != nil {
		t.Fatalf("k8s: %v", err)
	}
	return out
}

// WriteImage writes the root filesystem dir as an OCI image layout
// tarball (one uncompressed layer) named ref to out. Files belong to
// root; regular files, directories and symbolic links are kept, other
// kinds skipped; modification times are the epoch, so the same tree
// gives the same image.
func WriteImage(out, dir, ref string, cfg ImageConfig) error {
	if len(cfg.Env) == 0 {
		cfg.Env = []string{DefaultPath}
	}
	if cfg.WorkingDir == "" {
		cfg.WorkingDir = "/"
	}
	tag := ref[strings.LastIndex(ref, ":")+1:]
	if !strings.Contains(ref, ":") || strings.Contains(tag, "/") {
		return fmt.Errorf("k8s: image reference %q has no tag", ref)
	}
	work, err := os.MkdirTemp(filepath.Dir(out), ".image-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(work) }()
	layer := filepath.Join(work, "layer.tar")
	layerDigest, layerSize, err := writeLayer(layer, dir)
	if err != nil {
		return fmt.Errorf("k8s: image %s: layer of %s: %w", ref, dir, err)
	}
	platform := map[string]string{"architecture": runtime.GOARCH, "os": "linux"}
	config, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH, "os": "linux",
		"created": time.Unix(0, 0).UTC().Format(time.RFC3339),
		"config": map[string]any{"Entrypoint": cfg.Entrypoint, "Cmd": cfg.Cmd, "Env": cfg.Env,
			"WorkingDir": cfg.WorkingDir},
		"rootfs":  map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
		"history": []map[string]string{{"created_by": "mgpu test/k8s WriteImage"}},
	})
	if err != nil {
		return err
	}
	manifest, err := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": descriptor("application/vnd.oci.image.config.v1+json", digestOf(config), int64(len(config))),
		"layers": []any{descriptor("application/vnd.oci.image.layer.v1.tar", layerDigest, layerSize)},
	})
	if err != nil {
		return err
	}
	md := descriptor("application/vnd.oci.image.manifest.v1+json", digestOf(manifest), int64(len(manifest)))
	md["platform"] = platform
	md["annotations"] = map[string]string{"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []any{md}})
	if err != nil {
		return err
	}

	f, err := os.Create(out) //nolint:gosec // the caller's path
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	files := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
		{blobPath(digestOf(config)), config},
		{blobPath(digestOf(manifest)), manifest},
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: time.Unix(0, 0)}); err != nil {
			_ = f.Close()
			return err
		}
	}
	for _, e := range files {
		if err := writeTarFile(tw, e.name, int64(len(e.data)), strings.NewReader(string(e.data))); err != nil {
			_ = f.Close()
			return err
		}
	}
	lf, err := os.Open(layer) //nolint:gosec // ours
	if err != nil {
		_ = f.Close()
		return err
	}
	err = writeTarFile(tw, blobPath(layerDigest), layerSize, lf)
	_ = lf.Close()
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func descriptor(mediaType, digest string, size int64) map[string]any {
	return map[string]any{"mediaType": mediaType, "digest": digest, "size": size}
}

func digestOf(data []byte) string {
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func blobPath(digest string) string { return "blobs/sha256/" + strings.TrimPrefix(digest, "sha256:") }

func writeTarFile(tw *tar.Writer, name string, size int64, r io.Reader) error {
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: size, ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	_, err := io.Copy(tw, r)
	return err
}

// writeLayer writes the tree dir as a tar file and returns its digest
// (the layer's diff ID, uncompressed) and size.
func writeLayer(out, dir string) (string, int64, error) {
	f, err := os.Create(out) //nolint:gosec // ours
	if err != nil {
		return "", 0, err
	}
	h := sha256.New()
	cw := &countWriter{w: io.MultiWriter(f, h)}
	tw := tar.NewWriter(cw)
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: filepath.ToSlash(rel), Mode: int64(info.Mode().Perm()), ModTime: time.Unix(0, 0), Format: tar.FormatPAX}
		if info.Mode()&fs.ModeSetuid != 0 {
			hdr.Mode |= 0o4000
		}
		if info.Mode()&fs.ModeSticky != 0 {
			hdr.Mode |= 0o1000
		}
		switch {
		case info.IsDir():
			hdr.Typeflag, hdr.Name = tar.TypeDir, hdr.Name+"/"
			return tw.WriteHeader(hdr)
		case info.Mode()&fs.ModeSymlink != 0:
			if hdr.Linkname, err = os.Readlink(path); err != nil {
				return err
			}
			hdr.Typeflag = tar.TypeSymlink
			return tw.WriteHeader(hdr)
		case info.Mode().IsRegular():
			hdr.Typeflag, hdr.Size = tar.TypeReg, info.Size()
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
			src, err := os.Open(path) //nolint:gosec // the caller's tree
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, src)
			_ = src.Close()
			return err
		}
		return nil // devices, sockets, fifos: not in an image
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", 0, err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), cw.n, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// buildPauseImage builds ./pause (static) and writes PauseImage's tarball
// under dir.
func buildPauseImage(dir string) (string, error) {
	rootfs := filepath.Join(dir, "pause-rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil { //nolint:gosec // a root filesystem
		return "", err
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go") //nolint:staticcheck // only a fallback
	}
	cmd := exec.Command(goBin, "build", "-trimpath", "-ldflags=-s -w", "-o", filepath.Join(rootfs, "pause"), //nolint:gosec // the Go toolchain
		"github.com/mgpu-dev/mgpu/test/k8s/pause")
	cmd.Env = append(envWithout(os.Environ(), "CGO_ENABLED"), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("k8s: build the pause program (from within the mgpu module): %w\n%s", err, out)
	}
	out := filepath.Join(dir, "pause.tar")
	if err := WriteImage(out, rootfs, PauseImage, ImageConfig{Entrypoint: []string{"/pause"}}); err != nil {
		return "", err
	}
	return out, nil
}
