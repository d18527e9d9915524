package shim_test

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"
)

// The shim's dlsym answers lookups on the driver's handles with its wrappers
// for interposed names only, and keeps RTLD_NEXT working for everyone else.
func TestDlsymHonoursHandle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	newServer(t, e.run, 0)
	dir := t.TempDir()
	build := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("gcc", args...).CombinedOutput(); err != nil { //nolint:gosec // test build
			t.Fatalf("gcc %v: %v\n%s", args, err, out)
		}
	}
	build("-shared", "-fPIC", "-o", filepath.Join(dir, "libnext_a.so"), "testdata/next_a.c", "-ldl")
	build("-shared", "-fPIC", "-o", filepath.Join(dir, "libnext_b.so"), "testdata/next_b.c")
	probe := filepath.Join(dir, "dlsym_probe")
	build("-o", probe, "testdata/dlsym_probe.c", "-L"+dir, "-Wl,--no-as-needed", "-lnext_a", "-lnext_b", "-ldl", "-Wl,-rpath,"+dir)
	cuda := filepath.Join(fakeDir, "libcuda.so.1")
	nvml := filepath.Join(fakeDir, "libnvidia-ml.so.1")
	for _, asan := range []bool{false, true} {
		t.Run(fmt.Sprintf("asan=%v", asan), func(t *testing.T) {
			e.asan = asan
			lib := shimLib
			if asan {
				lib = asanLib
			}
			r := e.run1(probe)
			if r.code != 0 {
				t.Fatalf("exit %d: %s", r.code, r.err)
			}
			got := kv(r.out)
			want := map[string]string{
				"cuda.cuGetProcAddress_v2":        lib,
				"cuda.cuGetProcAddress":           lib,
				"cuda.cuMemAlloc_v2":              lib,
				"cuda.cuLaunchKernel_ptsz":        lib,
				"cuda.cuDeviceGet":                cuda,
				"cuda.cuEventRecord":              cuda,
				"nvml.nvmlDeviceGetMemoryInfo_v2": lib,
				"nvml.nvmlInit_v2":                nvml,
				"default.cuMemAlloc_v2":           lib,
				"default.cuDeviceGet":             "none", // the driver was dlopened RTLD_LOCAL
				"cuda.no_such_symbol":             "none",
				"next":                            "b",
			}
			for k, w := range want {
				g := got[k]
				if g != w && (w == "none" || w == "b" || !sameFile(g, w)) {
					t.Errorf("%s = %q, want %q", k, g, w)
				}
			}
		})
	}
}

func sameFile(a, b string) bool {
	ra, err1 := filepath.EvalSymlinks(a)
	rb, err2 := filepath.EvalSymlinks(b)
	return err1 == nil && err2 == nil && ra == rb
}
