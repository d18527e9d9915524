package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/mgpu-dev/mgpu/test/fakecuda"
)

var specSeq atomic.Int64

// Applets of the static busybox linked into the root filesystem's /bin.
var busyboxApplets = []string{"sh", "cat", "ls", "stat", "test", "touch", "grep", "env", "echo", "sleep",
	"sed", "readlink", "kill", "true", "false", "wc", "head", "ps", "mkdir", "cut", "find", "id"}

// BuildRootfs writes a small root filesystem into dir for the containers:
//   - Debian's static busybox (/bin/busybox and applets);
//   - /bin/mgpu-workload (dynamically linked) with every library ldd finds
//     for it and for the shim, at the same paths (the dynamic loader
//     included), and fakecuda's libcuda.so.1 and libnvidia-ml.so.1 beside
//     libc, where the loader looks by default (a GPU container gets the
//     driver's libraries there too);
//   - /bin/probe, a static helper (testdata/probe) that attaches to the
//     enforcer like the shim and prints what its region says.
//
// The shim itself is not in it: the CDI spec mounts it; shim is the file
// whose libraries the root filesystem must hold.
func BuildRootfs(dir, build, shim string) error {
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil { //nolint:gosec // a root filesystem
		return err
	}
	if err := copyFile("/bin/busybox", filepath.Join(bin, "busybox"), 0o755); err != nil {
		return fmt.Errorf("e2e: rootfs: %w (install busybox-static: test/e2e/deps.sh)", err)
	}
	for _, app := range busyboxApplets {
		if err := os.Symlink("busybox", filepath.Join(bin, app)); err != nil {
			return err
		}
	}
	for _, d := range []string{"tmp", "etc", "e2e"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil { //nolint:gosec // a root filesystem
			return err
		}
	}
	if err := os.Chmod(filepath.Join(dir, "tmp"), 0o1777); err != nil { //nolint:gosec // /tmp
		return err
	}
	fake := filepath.Join(build, "fakecuda")
	workload := filepath.Join(build, "bin", "mgpu-workload")
	if err := copyFile(workload, filepath.Join(bin, "mgpu-workload"), 0o755); err != nil {
		return err
	}
	libs := map[string]string{} // path in the rootfs -> host file
	var libcDir string
	for _, obj := range []string{workload, shim,
		filepath.Join(fake, "libcuda.so.1"), filepath.Join(fake, "libnvidia-ml.so.1")} {
		deps, err := lddDeps(obj, fake)
		if err != nil {
			return err
		}
		for name, path := range deps {
			if strings.HasPrefix(path, fake+"/") {
				continue // placed below
			}
			libs[path] = path
			if name == "libc.so.6" {
				libcDir = filepath.Dir(path)
			}
		}
	}
	if libcDir == "" {
		return fmt.Errorf("e2e: rootfs: ldd %s shows no libc.so.6", workload)
	}
	for _, l := range []string{"libcuda.so.1", "libnvidia-ml.so.1"} {
		libs[filepath.Join(libcDir, l)] = filepath.Join(fake, l)
	}
	// The dynamic loader also where a distribution has it, beside libc: a
	// library namespace of its own (dlmopen, the hostile-tenant tests)
	// loads it by name from the library path.
	for in, host := range libs {
		if strings.HasPrefix(filepath.Base(in), "ld-linux") && filepath.Dir(in) != libcDir {
			libs[filepath.Join(libcDir, filepath.Base(in))] = host
		}
	}
	for in, host := range libs {
		real, err := filepath.EvalSymlinks(host)
		if err != nil {
			return err
		}
		if err := copyFile(real, filepath.Join(dir, in), 0o755); err != nil {
			return err
		}
	}
	root, err := repoRoot(build)
	if err != nil {
		return err
	}
	cmd := exec.Command("go", "build", "-o", filepath.Join(bin, "probe"), "./test/e2e/testdata/probe")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("e2e: build probe: %w\n%s", err, out)
	}
	return nil
}

// lddDeps returns the libraries ldd lists for obj (soname or loader path ->
// resolved path), with the simulated driver's directory on the search path.
func lddDeps(obj, fakeDir string) (map[string]string, error) {
	cmd := exec.Command("ldd", obj)
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+fakeDir)
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("e2e: ldd %s: %w", obj, err)
	}
	deps := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			deps[f[0]] = f[2]
		case len(f) >= 3 && f[1] == "=>":
			return nil, fmt.Errorf("e2e: ldd %s: %s not found", obj, f[0])
		case len(f) >= 1 && strings.HasPrefix(f[0], "/"): // the dynamic loader
			deps[f[0]] = f[0]
		}
	}
	return deps, nil
}

// repoRoot is the module root above the build directory, above
// fakecuda.BuildDir() (build/ is at the root unless MGPU_BUILD says
// otherwise), or above the working directory.
func repoRoot(build string) (string, error) {
	starts := []string{filepath.Dir(build)}
	if b, err := fakecuda.BuildDir(); err == nil {
		starts = append(starts, filepath.Dir(b))
	}
	for _, start := range append(starts, ".") {
		dir, err := filepath.Abs(start)
		if err != nil {
			return "", err
		}
		for {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				if _, err := os.Stat(filepath.Join(dir, "test", "e2e", "testdata", "probe")); err == nil {
					return dir, nil
				}
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return "", fmt.Errorf("e2e: the mgpu repository is not above %s or the working directory", build)
}
