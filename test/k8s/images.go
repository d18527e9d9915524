package k8s

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/mgpu-dev/mgpu/internal/ociimage"
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

// WriteImage writes the root filesystem dir as an OCI archive (one
// layer, internal/ociimage) named ref to out. Files belong to root;
// regular files, directories and symbolic links are kept, other kinds
// skipped; modification times are the epoch, so the same tree gives the
// same image.
func WriteImage(out, dir, ref string, cfg ImageConfig) error {
	if len(cfg.Env) == 0 {
		cfg.Env = []string{DefaultPath}
	}
	if cfg.WorkingDir == "" {
		cfg.WorkingDir = "/"
	}
	es, err := ociimage.Tree(dir)
	if err != nil {
		return fmt.Errorf("k8s: image %s: %w", ref, err)
	}
	_, err = ociimage.Write(out, ociimage.Image{Ref: ref, Arch: runtime.GOARCH, Entries: es,
		Config: ociimage.Config{Entrypoint: cfg.Entrypoint, Cmd: cfg.Cmd, Env: cfg.Env, WorkingDir: cfg.WorkingDir}})
	if err != nil {
		return fmt.Errorf("k8s: image %s: %w", ref, err)
	}
	return nil
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
