// Command image is `make image`: it writes mgpu's container image, every
// binary, the shim and the default node configuration, as an OCI archive
// (an OCI image layout in a tar file), with no registry and no container
// daemon. The files sit where the .deb and .rpm put them (docs/install.md);
// the cgo binaries come with the host's C library and loader, found from
// their ELF headers. The same build gives the same digest.
//
//	go run ./packaging/image -build build -version 1.2.3 -out build/dist/mgpu-image.tar
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/mgpu-dev/mgpu/internal/ociimage"
)

// binaries are the commands the image holds, at /usr/bin.
var binaries = []string{"mgpu-cli", "kubectl-inspect-mgpu", "mgpu-device-plugin", "mgpu-enforcer", "mgpu-hook", "mgpu-webhook"}

// ShimPath is where the image (and the packages) hold the shim; a node's
// CDI spec names the copy the installer puts on the host.
const ShimPath = "/usr/lib/mgpu/libmgpu-shim.so"

func main() {
	build := flag.String("build", "build", "the build directory (`make build`'s output: bin/, lib/)")
	config := flag.String("config", "packaging/config/config.toml", "the default node configuration, installed at /etc/mgpu/config.toml")
	version := flag.String("version", "", "the image's version (its tag is the version with every character but letters, digits, '_', '.' and '-' turned into '-'); required")
	repo := flag.String("repository", "ghcr.io/mgpu-dev/mgpu", "the image's name without the tag")
	out := flag.String("out", "", "the OCI archive to write; required")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: image -version V -out FILE [flags]\n\nWrites mgpu's container image as an OCI archive (docs/install.md \"The image\").\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 || *version == "" || *out == "" {
		flag.Usage()
		os.Exit(2)
	}
	tag := ociimage.Tag(*version)
	if tag == "" {
		fmt.Fprintf(os.Stderr, "image: version %q gives no valid tag\n", *version)
		os.Exit(2)
	}
	ref := *repo + ":" + tag
	img, err := image(*build, *config, ref, *version)
	if err == nil {
		err = os.MkdirAll(filepath.Dir(*out), 0o755) //nolint:gosec // an output directory
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
	d, err := ociimage.Write(*out, img)
	if err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%s: %s (manifest %s)\n", *out, ref, d)
}

// image gathers the image's files from the build directory.
func image(build, config, ref, version string) (ociimage.Image, error) {
	var es []ociimage.Entry
	var bins []string
	for _, b := range binaries {
		p := filepath.Join(build, "bin", b)
		if _, err := os.Stat(p); err != nil {
			return ociimage.Image{}, fmt.Errorf("%w (run make build first)", err)
		}
		bins = append(bins, p)
		es = append(es, ociimage.Entry{Path: "/usr/bin/" + b, Src: p, Mode: 0o755})
	}
	shim := filepath.Join(build, "lib", "libmgpu-shim.so")
	if _, err := os.Stat(shim); err != nil {
		return ociimage.Image{}, fmt.Errorf("%w (run make build first)", err)
	}
	if _, err := os.Stat(config); err != nil {
		return ociimage.Image{}, err
	}
	es = append(es,
		ociimage.Entry{Path: ShimPath, Src: shim, Mode: 0o644},
		ociimage.Entry{Path: "/etc/mgpu/config.toml", Src: config, Mode: 0o644},
		ociimage.Entry{Path: "/tmp", Mode: 0o777 | os.ModeSticky},
	)
	libs, err := ociimage.Libraries(bins...)
	if err != nil {
		return ociimage.Image{}, err
	}
	es = append(es, libs...)
	return ociimage.Image{
		Ref: ref, Arch: runtime.GOARCH, Entries: es,
		Config: ociimage.Config{
			Cmd: []string{"/usr/bin/mgpu-cli", "--help"},
			Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			Labels: map[string]string{
				"org.opencontainers.image.title":    "mgpu",
				"org.opencontainers.image.version":  version,
				"org.opencontainers.image.source":   "https://github.com/mgpu-dev/mgpu",
				"org.opencontainers.image.licenses": "Apache-2.0",
				"org.opencontainers.image.description": strings.Join([]string{
					"mgpu: GPU sharing for containers with memory and compute quotas.",
					"Binaries in /usr/bin, the shim in /usr/lib/mgpu, the default node configuration in /etc/mgpu.",
				}, " "),
			},
			WorkingDir: "/",
		},
	}, nil
}
