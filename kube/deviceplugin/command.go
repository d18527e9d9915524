package deviceplugin

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/logging"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/dra"
	"github.com/mgpu-dev/mgpu/kube/kubeclient"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

const help = `mgpu-device-plugin is mgpu's kubelet device plugin. It serves, by the
node's scheduling mode (the label ` + ModeLabel + `, else --default-mode):

  mode      compute (device plugin)            memory
  mgpu      ` + string(ResourceName) + `       ` + string(MemoryResourceName) + ` (MiB, node capacity)
  core_mem  aliyun.com/gpu-core.percentage     aliyun.com/gpu-mem (GiB, device plugin)
  default   nvidia.com/gpu (whole GPUs)        none (each GPU with all its memory)
  topology  aliyun.com/gpu (whole GPUs, the    none
            nearest set by the GPUs' topology)
  cgpu      none: shared equally under the     aliyun.com/gpu-mem (GiB, device plugin),
            GPUs' burst policy                 isolated
  share     none, nothing enforced             aliyun.com/gpu-mem, scheduling only
  mps       NVIDIA MPS (real GPUs only)        aliyun.com/gpu-mem, scheduling only (the
                                               MPS limit is advisory, docs/kubernetes.md)
  dra       none: ResourceClaims of the DRA driver ` + dra.DriverName + ` (DeviceClass
            ` + dra.DeviceClassName + `), one device per GPU with consumable capacities
            cores and memory, placed per GPU by the scheduler

Compute is percent of a GPU's time (100 = one whole GPU, multiples of 100 =
whole GPUs); the other modes' resources are 0. A mode change waits until no
container holds device IDs of the current mode, and from dra until no claim
is prepared (drain the node's GPU pods).
Each resource has its socket in the device-plugin directory (` + SocketName + `,
mgpu-ack-core.sock, mgpu-ack-default.sock, mgpu-ack-topology.sock,
mgpu-ack-mem.sock); the plugin registers with the kubelet there, and again
whenever the kubelet restarts.

Each GPU of the node is 100 device IDs (default mode: one, mgpu-<gpu>-00, a
whole GPU), mgpu-<gpu>-<k> with k = 00..99
(mgpu-0-00 .. mgpu-0-99 for GPU 0), healthy while the GPU's enforcer
answers. A container given N < 100 IDs of one GPU gets that GPU's CDI device
(e.g. mgpu.io/gpu=0) and MGPU_CORE=N; one given all 100 IDs of each of
several GPUs gets their CDI devices and MGPU_CORE=100. aliyun.com/gpu-mem is
one ID per GiB of each GPU, mgpu-<gpu>-gib-<k>; in cgpu, share and mps a
container's IDs are all of one GPU, which they choose. The kubelet's choice
of IDs follows the node's label ack.node.gpu.placement, else --placement
(binpack fills the fullest GPU first, spread the emptiest).

It is also the node agent, and needs the API server for that (--kubeconfig,
$KUBECONFIG, or the pod's service account when it runs in a pod):
  - it publishes the mode's memory as node capacity, and the node labels
    vke.node.gpu.schedule=mgpu, the policy label
    vke.volcengine.com/mgpu-compute-policy and the card-model labels of
    mgpu-cli node labels;
  - it answers mgpu-hook, on <run_dir>/` + agentapi.SocketName + `, which quota a
    container has: its own pod's compute, memory and policy annotation, on
    the GPUs the kubelet allocated to it (PodResources API); in mode dra,
    the shares of its pod's ResourceClaims that the driver prepared;
  - it runs the DRA driver ` + dra.DriverName + `: registered with the kubelet
    (<kubelet-dir>/plugins_registry), its ResourceSlice lists one device per
    GPU in mode dra and none otherwise; the claims it prepares are kept in
    <kubelet-dir>/plugins/` + dra.DriverName + `/` + dra.CheckpointName + `.
See docs/kubernetes.md.

Usage: mgpu-device-plugin [flags]

Flags:
`

// Command is mgpu-device-plugin: it parses args (without the program
// name), serves until SIGTERM or SIGINT, and returns the exit status: 2
// for bad flags or configuration, 1 when the plugin cannot run. --help
// goes to stdout, errors are one line on stderr, logs go to stderr.
func Command(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("mgpu-device-plugin", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are written below, in one line
	cfgPath := fs.String("config", "", "node configuration `FILE` (default $"+config.EnvPath+" or "+config.DefaultPath+")")
	dir := fs.String("device-plugin-dir", strings.TrimSuffix(DefaultDir, "/"), "the kubelet's device-plugin `DIR`, where kubelet.sock is and "+SocketName+" is created")
	mode := fs.String("default-mode", SchemeMGPU.Mode, "`MODE` of a node without the label "+ModeLabel+": "+modeNames())
	place := fs.String("placement", placement.Binpack.String(), "`POLICY` of preferred allocations across GPUs: binpack or spread (as the node label ack.node.gpu.placement)")
	kubeconfig := fs.String("kubeconfig", "", "`FILE` of the API server's address and credentials (default $KUBECONFIG, else in-cluster)")
	nodeName := fs.String("node-name", "", "the `NAME` of this node's Node object (default $NODE_NAME, else the host name)")
	nodeInterval := fs.Duration("node-interval", DefaultPublishInterval, "how often to check the Node's labels and capacity and read its "+PlacementLabel+" label (`DURATION`)")
	podResources := fs.String("pod-resources-socket", DefaultPodResourcesSocket, "the kubelet's PodResources API `SOCKET`")
	kubeletDir := fs.String("kubelet-dir", dra.DefaultKubeletDir, "the kubelet's root `DIR`: the DRA driver registers in its plugins_registry and keeps its socket and checkpoint in plugins/"+dra.DriverName)
	mpsPipe := fs.String("mps-pipe-directory", DefaultMPSPipe, "the NVIDIA MPS control daemon's pipe `DIR` (mode mps), mounted into mps containers")
	level := fs.String("log-level", "info", "`LEVEL`: debug, info, warn or error")
	format := fs.String("log-format", "text", "`FORMAT`: text or json")
	fail := func(status int, format string, a ...any) int {
		fmt.Fprintf(stderr, "mgpu-device-plugin: "+format+"\n", a...)
		return status
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, help)
			fs.SetOutput(stdout)
			fs.PrintDefaults()
			return 0
		}
		return fail(2, "%v (see --help)", err)
	}
	if fs.NArg() > 0 {
		return fail(2, "takes no arguments, got %q (see --help)", fs.Arg(0))
	}
	pol, err := placement.ParsePolicy(*place)
	if err != nil {
		return fail(2, "--placement: %v", err)
	}
	defMode, err := ParseMode(*mode)
	if err != nil {
		return fail(2, "--default-mode: %v", err)
	}
	if *dir == "" {
		return fail(2, "--device-plugin-dir is empty")
	}
	if !filepath.IsAbs(*kubeletDir) {
		return fail(2, "--kubelet-dir %q: must be an absolute path", *kubeletDir)
	}
	if !filepath.IsAbs(*mpsPipe) {
		return fail(2, "--mps-pipe-directory %q: must be an absolute path", *mpsPipe)
	}
	log, err := logging.New(stderr, *level, *format)
	if err != nil {
		return fail(2, "%v", err)
	}

	if *nodeInterval <= 0 {
		return fail(2, "--node-interval %v: must be positive", *nodeInterval)
	}
	if *podResources == "" {
		return fail(2, "--pod-resources-socket is empty")
	}
	node, err := resolveNodeName(*nodeName)
	if err != nil {
		return fail(2, "%v", err)
	}

	cfg, err := config.Load(config.Resolve(*cfgPath))
	if err != nil {
		return fail(2, "%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// A node image enables the plugin before the node joins: the kubelet's
	// kubeconfig appears then. Wait for it rather than fail.
	if path := kubeconfigPath(*kubeconfig); path != "" {
		if err := waitForFile(ctx, path, log); err != nil {
			return fail(2, "%v", err)
		}
		if ctx.Err() != nil {
			log.Info("stopped")
			return 0
		}
	}
	client, err := kubeclient.Client(*kubeconfig)
	if err != nil {
		return fail(2, "%v", err)
	}
	devs, dist, err := device.ListWithTopology(cfg)
	if err != nil {
		return fail(1, "%v", err)
	}
	labels, warning, err := device.NodeLabels(cfg, devs)
	if err != nil {
		return fail(1, "%v", err)
	}
	if warning != "" {
		log.Warn(warning)
	}
	want := map[string]string{device.LabelSchedule: device.ScheduleMGPU}
	for _, l := range labels {
		want[l.Key] = l.Value
	}
	gpus := make([]int, len(devs))
	gpuMiB := make([]uint64, len(devs))
	uuids := map[int]string{}
	for i, d := range devs {
		gpus[i] = d.Index
		gpuMiB[i] = d.MemoryMiB()
		if d.UUID != "" {
			uuids[d.Index] = d.UUID
		}
	}
	allocs, err := NewPodResources(*podResources)
	if err != nil {
		return fail(2, "%v", err)
	}
	defer func() { _ = allocs.Close() }()
	var draErr atomic.Pointer[error]
	check := modeCheck(cfg, gpus, *mpsPipe, func() error {
		if e := draErr.Load(); e != nil {
			return *e
		}
		return nil
	})
	if err := check(defMode); err != nil {
		return fail(2, "--default-mode: %v", err)
	}
	resolver := NewResolver(node, gpus, NewAPIPods(client, node), allocs)
	resolver.SetScheme(defMode)
	pols := map[int]policy.Policy{}
	memMiB := map[int]uint64{}
	bare := map[int][]string{}
	for _, d := range devs {
		pols[d.Index] = cfg.Device(d.Index).ComputePolicy
		memMiB[d.Index] = d.MemoryMiB()
		bare[d.Index] = d.Nodes
	}
	resolver.SetGPUPolicies(pols)
	var draGPUs []dra.GPU
	for _, d := range devs {
		s := cfg.Device(d.Index)
		draGPUs = append(draGPUs, dra.GPU{Index: d.Index, UUID: d.UUID, Model: d.Name, MemoryMiB: d.MemoryMiB(),
			Policy: s.ComputePolicy, Switch: s.OnlineOfflineSwitch, MaxInstances: s.MaxInstances})
	}
	driver, err := dra.New(dra.Config{Node: node, CDIKind: cfg.CDIKind, GPUs: draGPUs, DataDir: dra.DataDir(*kubeletDir), Log: log})
	if err != nil {
		return fail(1, "%v", err)
	}
	resolver.SetClaims(driver)
	control, err := controlNodes(cfg)
	if err != nil {
		return fail(1, "%v", err)
	}
	// One plugin per resource; the node's mode (the first publish)
	// decides which ones list devices.
	var plugins []*Plugin
	for _, sch := range PluginSchemes() {
		opts := []Option{WithScheme(sch), WithDir(*dir), WithPolicy(pol), WithCDIKind(cfg.CDIKind), WithResolver(resolver),
			WithUUIDs(uuids), WithTopology(dist), WithLogger(log)}
		if sch.Core == ACKMemory.Core {
			opts = append(opts, WithMemory(memMiB), WithBareDevices(bare, control), WithMPSPipe(*mpsPipe))
		}
		p, err := New(gpus, NewEnforcerCards(cfg, gpus), append(opts, WithMode(defMode))...)
		if err != nil {
			return fail(1, "%v", err)
		}
		plugins = append(plugins, p)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	var wg sync.WaitGroup
	agentErr := make(chan error, 1)
	wg.Go(func() { agentErr <- ServeAgent(ctx, agentapi.Socket(cfg.RunDir), resolver, log) })
	pub := NewNodePublisher(client, node, want, gpuMiB, plugins, pol, log).WithModes(defMode, resolver, allocs).WithModeCheck(check).WithDRA(driver)
	pub.WithAllocation(func(ctx context.Context) allocview.Node {
		v := allocview.Collect(ctx, cfg, devs)
		if cur := pub.Current(); cur != nil && cur.Enforce.Bare() {
			if err := AddBare(ctx, allocs, &v); err != nil {
				log.Warn("the allocation annotation leaves out the containers of mode "+cur.Mode, "err", err)
			}
		}
		return v
	})
	wg.Go(func() { pub.Run(ctx, *nodeInterval) })
	runErr := make(chan error, len(plugins)+1)
	for _, p := range plugins {
		wg.Go(func() { runErr <- p.Run(ctx) })
	}
	health := NewEnforcerCards(cfg, gpus)
	wg.Go(func() {
		// The device plugins serve without it: the error is dra's alone.
		err := driver.Run(ctx, client, *kubeletDir, func(ctx context.Context) map[int]bool {
			ctx, cancel := context.WithTimeout(ctx, cardsTimeout)
			defer cancel()
			cards, _ := health.Cards(ctx) // a GPU missing is one whose enforcer does not answer
			up := map[int]bool{}
			for _, c := range cards {
				up[c.Index] = true
			}
			return up
		}, DefaultPollInterval)
		if err != nil {
			log.Error("the DRA driver cannot run; the node's mode cannot be dra", "err", err)
			draErr.Store(&err)
		}
	})
	var status int
	select {
	case err := <-agentErr:
		if err != nil {
			status = fail(1, "%v", err)
		}
	case err := <-runErr:
		if err != nil {
			status = fail(1, "%v", err)
		}
	}
	cancel()
	wg.Wait()
	if status == 0 {
		log.Info("stopped")
	}
	return status
}

// modeCheck is what a mode needs of this node: cgpu GPUs of a burst
// policy (under fixed-share each container would be capped at its core),
// mps real GPUs and an MPS control daemon (mgpu does not simulate MPS).
func modeCheck(cfg *config.Config, gpus []int, mpsPipe string, draErr func() error) func(Scheme) error {
	return func(s Scheme) error {
		switch s.Enforce {
		case EnforceDRA:
			if err := draErr(); err != nil {
				return fmt.Errorf("%s=%s needs the DRA driver, which cannot run: %w", ModeLabel, s.Mode, err)
			}
		case EnforceMemory:
			for _, g := range gpus {
				if p := cfg.Device(g).ComputePolicy; p == policy.FixedShare {
					return fmt.Errorf("%s=%s shares compute under the GPUs' own burst policy, and GPU %d runs %s, which would cap each container at %d%%; run guaranteed-burst-share or native-burst-share (the node config's compute_policy)", ModeLabel, s.Mode, g, p, cgpuCore)
				}
			}
		case EnforceMPS:
			if cfg.Backend == config.BackendSim {
				return fmt.Errorf("%s=%s needs NVIDIA MPS on real GPUs; this node's GPUs are simulated (backend sim), and mgpu does not simulate MPS", ModeLabel, s.Mode)
			}
			if ctl := filepath.Join(mpsPipe, "control"); !isSocket(ctl) {
				return fmt.Errorf("%s=%s needs an MPS control daemon, and %s is not its socket (start nvidia-cuda-mps-control -d, or set --mps-pipe-directory)", ModeLabel, s.Mode, ctl)
			}
		}
		return nil
	}
}

// controlNodes are the device nodes every GPU container needs (host paths).
func controlNodes(cfg *config.Config) ([]string, error) {
	b, err := device.Open(cfg)
	if err != nil {
		return nil, err
	}
	defer func() { _ = b.Close() }()
	return b.ControlNodes(), nil
}

// resolveNodeName is --node-name, else $NODE_NAME, else the host name.
func resolveNodeName(flagValue string) (string, error) {
	if flagValue != "" {
		return flagValue, nil
	}
	if v := os.Getenv("NODE_NAME"); v != "" {
		return v, nil
	}
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "", fmt.Errorf("no node name: set --node-name or $NODE_NAME (the host name is not known: %w)", err)
	}
	return strings.ToLower(h), nil
}

// kubeconfigPath is --kubeconfig, else $KUBECONFIG ("" for in-cluster).
func kubeconfigPath(flagValue string) string {
	if flagValue != "" {
		return flagValue
	}
	return os.Getenv("KUBECONFIG")
}

// Waiting for the kubeconfig: how often to look, and to say so.
const (
	kubeconfigPoll = time.Second
	kubeconfigSay  = time.Minute
)

// waitForFile returns once path exists or ctx ends; a path that cannot be
// looked at (other than missing) is an error.
func waitForFile(ctx context.Context, path string, log *slog.Logger) error {
	var said time.Time
	for {
		_, err := os.Stat(path)
		switch {
		case err == nil:
			if !said.IsZero() {
				log.Info("the kubeconfig is there", "path", path)
			}
			return nil
		case !errors.Is(err, os.ErrNotExist):
			return fmt.Errorf("kubeconfig %s: %w", path, err)
		}
		if time.Since(said) >= kubeconfigSay {
			log.Warn("waiting for the kubeconfig (the kubelet's, written when the node joins the cluster; set --kubeconfig or KUBECONFIG for another)", "path", path)
			said = time.Now()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(kubeconfigPoll):
		}
	}
}
