package cli

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	appsv1client "k8s.io/client-go/kubernetes/typed/apps/v1"

	"github.com/mgpu-dev/mgpu/cdi"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/fsutil"
	"github.com/mgpu-dev/mgpu/internal/version"
	"github.com/mgpu-dev/mgpu/kube/kubeconfig"
)

// Installing the node side from an image (the Helm chart's init
// container; docs/install.md "From the image"). What containers run from
// the host (the hook, the shim and the file that preloads it) goes into a
// directory of its own per build, <install-dir>/<version>-<digest>, never
// changed once written: a container maps the shim it started with for as
// long as it runs, so an upgrade adds a directory and points the node
// configuration and the CDI spec at it, and an old directory is removed
// only once no process maps its shim.

// installedMarker starts the node configuration node install writes; node
// uninstall removes only a configuration that starts with it.
const installedMarker = "# Written by mgpu-cli node install"

// installer does node install and node uninstall; paths are the host's,
// reached under hostRoot.
type installer struct {
	hostRoot   string // where the host's file system is mounted here ("/": this is the host)
	installDir string // the versions' parent directory
	configOut  string // the node configuration the CDI spec names
	source     string // the prefix this image holds bin/mgpu-hook and lib/mgpu/libmgpu-shim.so under
	proc       string // the proc file system that shows every process of the host (hostPID)
	out        io.Writer
}

func (in *installer) host(p string) string { return filepath.Join(in.hostRoot, p) }

func (in *installer) say(format string, a ...any) { fmt.Fprintf(in.out, format+"\n", a...) }

// install installs the files, writes the node configuration (from the
// configuration text cfgData, its prefix set to the new directory) and the
// CDI spec, and removes the versions no process uses. It returns the
// installed directory (a host path).
func (in *installer) install(cfgName string, cfgData []byte) (string, error) {
	if _, err := config.Parse(cfgName, cfgData); err != nil {
		return "", err
	}
	hook, err := os.ReadFile(filepath.Join(in.source, "bin", cdi.HookBinary))
	if err != nil {
		return "", fmt.Errorf("the hook to install: %w", err)
	}
	shim, err := os.ReadFile(filepath.Join(in.source, "lib", "mgpu", "libmgpu-shim.so"))
	if err != nil {
		return "", fmt.Errorf("the shim to install: %w", err)
	}
	sum := sha256.New()
	for _, b := range [][]byte{hook, shim} {
		_, _ = fmt.Fprintf(sum, "%d\n", len(b))
		_, _ = sum.Write(b)
	}
	name := versionDirName(version.Version, hex.EncodeToString(sum.Sum(nil))[:12])
	dir := filepath.Join(in.installDir, name)
	cfgText, err := installedConfig(cfgData, dir)
	if err != nil {
		return "", err
	}
	cfg, err := config.Parse(in.configOut, cfgText)
	if err != nil {
		return "", fmt.Errorf("the configuration with prefix %s: %w", dir, err)
	}
	files := map[string]struct {
		data []byte
		mode os.FileMode
	}{
		filepath.Join("bin", cdi.HookBinary):            {hook, 0o755},
		filepath.Join("lib", "mgpu", "libmgpu-shim.so"): {shim, 0o644},
		filepath.Join("lib", "mgpu", "ld.so.preload"):   {cdi.PreloadContent(cfg), 0o644},
	}
	if err := in.writeVersion(dir, files); err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(in.host(in.configOut)), 0o755); err != nil { //nolint:gosec // the hook reads it
		return "", err
	}
	if err := fsutil.WriteFileAtomic(in.host(in.configOut), cfgText, 0o644); err != nil {
		return "", err
	}
	spec, err := in.writeSpec(cfg)
	if err != nil {
		return "", err
	}
	in.say("installed %s (mgpu-hook, libmgpu-shim.so, ld.so.preload); wrote %s and %s", dir, in.configOut, spec)
	in.removeUnused(name)
	return dir, nil
}

// versionDirName is <version>-<digest>, the version as version.Slug
// writes it.
func versionDirName(v, digest string) string { return version.Slug(v) + "-" + digest }

// installedConfig is the node configuration to install: cfgData with its
// prefix set to dir, after a line saying who wrote it. The text is
// re-encoded (comments are dropped): the source is the chart's values.
func installedConfig(cfgData []byte, dir string) ([]byte, error) {
	m := map[string]any{}
	if _, err := toml.Decode(string(cfgData), &m); err != nil {
		return nil, err
	}
	m["prefix"] = dir
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s (%s) from its --config; the next run replaces it.\n", installedMarker, version.Version)
	fmt.Fprintf(&b, "# Edit the source (the Helm chart's node.config values), not this file.\n")
	if err := toml.NewEncoder(&b).Encode(m); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// writeVersion makes dir with files, unless it exists already with the
// same files (this build was installed before). A directory is written
// under a temporary name and renamed into place, so that dir is complete
// whenever it exists.
func (in *installer) writeVersion(dir string, files map[string]struct {
	data []byte
	mode os.FileMode
},
) error {
	hdir := in.host(dir)
	if st, err := os.Stat(hdir); err == nil {
		if !st.IsDir() {
			return fmt.Errorf("%s exists and is not a directory; remove it", dir)
		}
		for rel, f := range files {
			got, err := os.ReadFile(filepath.Join(hdir, rel)) //nolint:gosec // our own directory
			if err != nil || !bytes.Equal(got, f.data) {
				return fmt.Errorf("%s exists with other contents than this build's (%s); it is never changed once written: remove it when no container uses it", dir, rel)
			}
		}
		return nil
	}
	parent := in.host(in.installDir)
	if err := os.MkdirAll(parent, 0o755); err != nil { //nolint:gosec // containers' engines read it
		return err
	}
	var r [6]byte
	_, _ = rand.Read(r[:])
	tmp := filepath.Join(parent, ".tmp-"+filepath.Base(dir)+"-"+hex.EncodeToString(r[:]))
	defer func() { _ = os.RemoveAll(tmp) }()
	for rel, f := range files {
		p := filepath.Join(tmp, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil { //nolint:gosec // as above
			return err
		}
		if err := fsutil.WriteFileAtomic(p, f.data, f.mode); err != nil {
			return err
		}
	}
	if err := os.Chmod(tmp, 0o755); err != nil { //nolint:gosec // as above
		return err
	}
	if err := os.Rename(tmp, hdir); err != nil {
		return fmt.Errorf("install %s: %w", dir, err)
	}
	return nil
}

// writeSpec writes the CDI spec of cfg's devices and returns its path.
func (in *installer) writeSpec(cfg *config.Config) (string, error) {
	if cfg.Backend == config.BackendSim {
		if _, err := device.EnsureSimNodes(cfg); err != nil {
			return "", err
		}
	}
	b, err := device.Open(cfg)
	if err != nil {
		return "", err
	}
	defer func() { _ = b.Close() }()
	devs, err := b.Devices()
	if err != nil {
		return "", err
	}
	spec, err := cdi.Generate(cfg, devs, b.ControlNodes(), cdi.WithConfigPath(in.configOut))
	if err != nil {
		return "", err
	}
	p := filepath.Join(cfg.CDISpecDir, cdi.SpecFileName(cfg.CDIKind, cdi.FormatYAML))
	if err := os.MkdirAll(in.host(cfg.CDISpecDir), 0o755); err != nil { //nolint:gosec // engines read spec directories
		return "", err
	}
	return p, cdi.WriteFile(in.host(p), spec)
}

// removeUnused removes the version directories under installDir other
// than keep that no process maps the shim of, and leftovers of
// interrupted installs; it says what it kept and why.
func (in *installer) removeUnused(keep string) {
	parent := in.host(in.installDir)
	ents, err := os.ReadDir(parent)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			in.say("warning: cannot list %s: %v; old versions are left", in.installDir, err)
		}
		return
	}
	var old []string
	for _, e := range ents {
		switch {
		case !e.IsDir() || e.Name() == keep:
		case strings.HasPrefix(e.Name(), ".tmp-"):
			_ = os.RemoveAll(filepath.Join(parent, e.Name()))
		default:
			old = append(old, e.Name())
		}
	}
	if len(old) == 0 {
		return
	}
	users, err := in.shimUsers(parent, old)
	if err != nil {
		in.say("warning: %v; old versions are left: %s", err, strings.Join(old, ", "))
		return
	}
	for _, n := range old {
		if pids := users[n]; len(pids) > 0 {
			in.say("kept %s: its shim is mapped by %d process(es) (pid %s)", filepath.Join(in.installDir, n), len(pids), pidList(pids))
			continue
		}
		if err := os.RemoveAll(filepath.Join(parent, n)); err != nil {
			in.say("warning: remove %s: %v", filepath.Join(in.installDir, n), err)
			continue
		}
		in.say("removed %s: no process maps its shim", filepath.Join(in.installDir, n))
	}
}

func pidList(pids []int) string {
	s := make([]string, 0, 3)
	for i, p := range pids {
		if i == 3 {
			s = append(s, "...")
			break
		}
		s = append(s, strconv.Itoa(p))
	}
	return strings.Join(s, ", ")
}

// fileID is a file's device and inode, as /proc/<pid>/maps shows them.
type fileID struct {
	major, minor uint32
	ino          uint64
}

// shimUsers returns, per version directory name under parent, the pids
// of the processes that map its shim (whatever path their mount namespace
// shows it at: maps carries the file's device and inode). A process whose
// maps cannot be read makes it an error (a version could be in use), one
// that exits meanwhile does not.
func (in *installer) shimUsers(parent string, names []string) (map[string][]int, error) {
	byID := map[fileID]string{}
	for _, n := range names {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(parent, n, "lib", "mgpu", "libmgpu-shim.so"), &st); err != nil {
			continue // no shim: nothing can map it
		}
		byID[fileID{unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino}] = n
	}
	users := map[string][]int{}
	if len(byID) == 0 {
		return users, nil
	}
	ents, err := os.ReadDir(in.proc)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		f, err := os.Open(filepath.Join(in.proc, e.Name(), "maps"))
		if errors.Is(err, os.ErrPermission) {
			// A process whose memory this one may not inspect (the
			// host's init under some hypervisors): a container's
			// process would still show the shim bound into its mount
			// namespace, which anyone may read.
			ns, err := mountedShims(filepath.Join(in.proc, e.Name(), "mountinfo"), byID)
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("cannot read which files process %d maps or mounts (%w: node install needs the host's pid namespace and privileges)", pid, err)
			}
			for _, n := range ns {
				users[n] = append(users[n], pid)
			}
			continue
		}
		if err != nil {
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
				continue
			}
			return nil, fmt.Errorf("cannot read which files process %d maps (%w: node install needs the host's pid namespace and privileges)", pid, err)
		}
		seen := map[string]bool{}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			if id, ok := parseMapsID(sc.Text()); ok {
				if n, ok := byID[id]; ok && !seen[n] {
					seen[n] = true
					users[n] = append(users[n], pid)
				}
			}
		}
		_ = f.Close()
	}
	for _, p := range users {
		sort.Ints(p)
	}
	return users, nil
}

// mountedShims returns the version directories whose shim the mount
// namespace of a process binds somewhere, from its mountinfo: a mount of a
// shim's device whose root (the path in its file system) ends in
// <name>/lib/mgpu/libmgpu-shim.so.
func mountedShims(mountinfo string, byID map[fileID]string) ([]string, error) {
	data, err := os.ReadFile(mountinfo) //nolint:gosec // /proc
	if err != nil {
		return nil, err
	}
	var out []string
	seen := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		maj, mnr, ok := strings.Cut(f[2], ":")
		if !ok {
			continue
		}
		a, err1 := strconv.ParseUint(maj, 10, 32)
		b, err2 := strconv.ParseUint(mnr, 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		for id, n := range byID {
			if id.major == uint32(a) && id.minor == uint32(b) && !seen[n] &&
				strings.HasSuffix(f[3], "/"+n+"/lib/mgpu/libmgpu-shim.so") {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	return out, nil
}

// parseMapsID reads the device and inode of a /proc/<pid>/maps line:
// "address perms offset MAJ:MIN inode [path]".
func parseMapsID(line string) (fileID, bool) {
	f := strings.Fields(line)
	if len(f) < 5 {
		return fileID{}, false
	}
	maj, mnr, ok := strings.Cut(f[3], ":")
	if !ok {
		return fileID{}, false
	}
	a, err1 := strconv.ParseUint(maj, 16, 32)
	b, err2 := strconv.ParseUint(mnr, 16, 32)
	ino, err3 := strconv.ParseUint(f[4], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || ino == 0 {
		return fileID{}, false
	}
	return fileID{uint32(a), uint32(b), ino}, true
}

// uninstall removes what install wrote: the CDI spec and the node
// configuration (only one install wrote, by its first line), and every
// version directory no process maps the shim of.
func (in *installer) uninstall() error {
	data, err := os.ReadFile(in.host(in.configOut))
	switch {
	case errors.Is(err, os.ErrNotExist):
		in.say("%s is not there: no configuration or CDI spec to remove", in.configOut)
	case err != nil:
		return err
	case !bytes.HasPrefix(data, []byte(installedMarker)):
		in.say("kept %s: node install did not write it (a package's or the operator's), nor its CDI spec", in.configOut)
	default:
		cfg, err := config.Parse(in.configOut, data)
		if err != nil {
			return err
		}
		spec := filepath.Join(cfg.CDISpecDir, cdi.SpecFileName(cfg.CDIKind, cdi.FormatYAML))
		for _, p := range []string{spec, in.configOut} {
			if err := os.Remove(in.host(p)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
			in.say("removed %s", p)
		}
	}
	in.removeUnused("")
	if err := os.Remove(in.host(in.installDir)); err == nil {
		in.say("removed %s", in.installDir)
	}
	return nil
}

// daemonSetGone reports whether the DaemonSet namespace/name is gone or
// being deleted: the node's files go only with it, not when its pods are
// replaced by an update. A release being uninstalled also loses the
// ServiceAccount and Role that let the pod ask (Helm deletes them in the
// same pass, without waiting for the pods): a token no longer accepted
// (401) or no longer allowed (403) says the same, which no update does.
var daemonSetGone = func(ctx context.Context, kubeconfigPath, namespace, name string) (bool, error) {
	c, err := kubeconfig.User(kubeconfigPath)
	if err != nil {
		return false, err
	}
	cs, err := appsv1client.NewForConfig(c)
	if err != nil {
		return false, err
	}
	ds, err := cs.DaemonSets(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) || apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return ds.DeletionTimestamp != nil, nil
}

func installerOf(c *cli.Context) (*installer, error) {
	for _, f := range []string{"host-root", "install-dir", "config-out"} {
		if v := c.String(f); !filepath.IsAbs(v) {
			return nil, usagef("--%s %q: want an absolute path", f, v)
		}
	}
	return &installer{hostRoot: c.String("host-root"), installDir: filepath.Clean(c.String("install-dir")),
		configOut: filepath.Clean(c.String("config-out")), source: c.String("source-prefix"), proc: c.String("proc"),
		out: c.App.Writer}, nil
}

func nodeInstall(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("node install takes no arguments, got %q", c.Args().First())
	}
	in, err := installerOf(c)
	if err != nil {
		return err
	}
	p := config.Resolve(c.String("config"))
	data, err := os.ReadFile(p) //nolint:gosec // the operator's configuration
	if err != nil {
		return fmt.Errorf("the configuration to install: %w", err)
	}
	cfg, err := config.Parse(p, data)
	if err != nil {
		return err
	}
	step, err := engineStepOf(c, specDirsOf(cfg))
	if err != nil {
		return err
	}
	if _, err = in.install(p, data); err != nil {
		return err
	}
	return in.configureEngine(c.Context, step)
}

// specDirsOf are the directories an engine must scan for cfg's spec: the
// default ones, and cfg's cdi_spec_dir when it is another.
func specDirsOf(cfg *config.Config) []string {
	dirs := slices.Clone(cdi.DefaultSpecDirs)
	if !slices.Contains(dirs, cfg.CDISpecDir) {
		dirs = append(dirs, cfg.CDISpecDir)
	}
	return dirs
}

func nodeUninstall(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("node uninstall takes no arguments, got %q", c.Args().First())
	}
	in, err := installerOf(c)
	if err != nil {
		return err
	}
	step, err := engineStepOf(c, nil)
	if err != nil {
		return err
	}
	if v := c.String("unless-daemonset"); v != "" {
		ns, name, ok := strings.Cut(v, "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
			return usagef("--unless-daemonset %q: want NAMESPACE/NAME", v)
		}
		ctx, cancel := context.WithTimeout(c.Context, 20*time.Second)
		defer cancel()
		gone, err := daemonSetGone(ctx, c.String("kubeconfig"), ns, name)
		if err != nil {
			return fmt.Errorf("is the DaemonSet %s still there: %w; nothing removed", v, err)
		}
		if !gone {
			in.say("the DaemonSet %s is still there (its pods are being replaced, not removed): nothing removed", v)
			return nil
		}
	}
	rec, err := in.loadEngineRecord()
	if err != nil {
		return err
	}
	if rec != nil {
		if err := in.revertEngine(c.Context, step, rec); err != nil {
			return err
		}
	}
	return in.uninstall()
}

func init() {
	installFlags := []cli.Flag{
		&cli.StringFlag{Name: "host-root", Value: "/", Usage: "where the host's file system is mounted in this container (`DIR`)"},
		&cli.StringFlag{Name: "install-dir", Value: "/opt/mgpu", Usage: "the host `DIR` that holds one directory per installed build"},
		&cli.StringFlag{Name: "config-out", Value: config.DefaultPath, Usage: "the host `FILE` of the node configuration the CDI spec names"},
	}
	nodeCommand.Subcommands = append(nodeCommand.Subcommands, &cli.Command{
		Name:      "install",
		Usage:     "install the hook and the shim from this image onto the host, with the node configuration and the CDI spec",
		UsageText: "mgpu-cli --config FILE node install [--host-root DIR] [--install-dir DIR] [--config-out FILE]",
		Description: "Copies mgpu-hook and libmgpu-shim.so (from --source-prefix) into INSTALL-DIR/<version>-<digest>/,\n" +
			"a directory that is never changed once written; writes --config with its prefix set to that\n" +
			"directory to --config-out, and the CDI spec of the node's GPUs to the configuration's\n" +
			"cdi_spec_dir; then removes the directories of other builds whose shim no process maps\n" +
			"(read from /proc/*/maps: run it in the host's pid namespace). Paths are the host's; with\n" +
			"--host-root they are reached under it. With --engine it also configures containerd or Docker\n" +
			"to read CDI specs (as mgpu-cli runtime configure does; the engine's files at their own paths),\n" +
			"records what they held in INSTALL-DIR/" + engineRecordName + " and runs --engine-restart\n" +
			"when a file changed; without --engine it puts back what an earlier --engine configured.\n" +
			"The Helm chart's init container (docs/install.md).",
		Flags: append(append(append([]cli.Flag{}, installFlags...), engineFlags(true)...),
			&cli.StringFlag{Name: "source-prefix", Value: "/usr", Usage: "the `DIR` this image holds bin/mgpu-hook and lib/mgpu/libmgpu-shim.so under"},
			&cli.StringFlag{Name: "proc", Value: "/proc", Usage: "the proc file system that shows the host's processes (`DIR`)", Hidden: true},
		),
		Action: nodeInstall,
	}, &cli.Command{
		Name:      "uninstall",
		Usage:     "remove what node install wrote on the host",
		UsageText: "mgpu-cli node uninstall [--host-root DIR] [--install-dir DIR] [--config-out FILE] [--unless-daemonset NAMESPACE/NAME]",
		Description: "Removes the CDI spec and the node configuration node install wrote (a configuration it\n" +
			"did not write is kept, and its spec), and every directory under --install-dir whose shim no\n" +
			"process maps; a directory still in use is kept and named. With --unless-daemonset it does\n" +
			"nothing while that DaemonSet exists and is not being deleted: the chart's preStop hook, so\n" +
			"that a rolling update keeps the node's files and helm uninstall removes them. An engine\n" +
			"node install configured (--engine) gets its files back where they still hold what node\n" +
			"install wrote (a file changed since is kept and named), then --engine-restart runs.",
		Flags: append(append(append([]cli.Flag{}, installFlags...), engineFlags(false)...),
			&cli.StringFlag{Name: "unless-daemonset", Usage: "do nothing while the DaemonSet `NAMESPACE/NAME` exists"},
			&cli.StringFlag{Name: "kubeconfig", Usage: "the kubeconfig `FILE` for --unless-daemonset (default: $KUBECONFIG, else ~/.kube/config, else in-cluster)"},
			&cli.StringFlag{Name: "proc", Value: "/proc", Usage: "the proc file system that shows the host's processes (`DIR`)", Hidden: true},
		),
		Action: nodeUninstall,
	})
}
