package deviceplugin

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os/signal"
	"strings"
	"syscall"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/logging"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

const help = `mgpu-device-plugin is mgpu's kubelet device plugin. It serves the resource
` + ResourceName + ` (percent of a GPU's time; 100 = one whole GPU,
multiples of 100 = whole GPUs) on the socket ` + SocketName + ` of the device-plugin
directory, registers with the kubelet there, and registers again whenever
the kubelet restarts.

Each GPU of the node is 100 device IDs, mgpu-<gpu>-<k> with k = 00..99
(mgpu-0-00 .. mgpu-0-99 for GPU 0), healthy while the GPU's enforcer
answers. A container given N < 100 IDs of one GPU gets that GPU's CDI device
(e.g. mgpu.io/gpu=0) and MGPU_CORE=N; one given all 100 IDs of each of
several GPUs gets their CDI devices and MGPU_CORE=100. The kubelet's choice
of IDs follows --placement (binpack fills the fullest GPU first, spread
the emptiest); see docs/kubernetes.md.

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
	place := fs.String("placement", placement.Binpack.String(), "`POLICY` of preferred allocations across GPUs: binpack or spread (as the node label ack.node.gpu.placement)")
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
	if *dir == "" {
		return fail(2, "--device-plugin-dir is empty")
	}
	log, err := logging.New(stderr, *level, *format)
	if err != nil {
		return fail(2, "%v", err)
	}

	cfg, err := config.Load(config.Resolve(*cfgPath))
	if err != nil {
		return fail(2, "%v", err)
	}
	devs, err := device.List(cfg)
	if err != nil {
		return fail(1, "%v", err)
	}
	gpus := make([]int, len(devs))
	for i, d := range devs {
		gpus[i] = d.Index
	}
	p, err := New(gpus, NewEnforcerCards(cfg, gpus),
		WithDir(*dir), WithPolicy(pol), WithCDIKind(cfg.CDIKind), WithLogger(log))
	if err != nil {
		return fail(1, "%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := p.Run(ctx); err != nil {
		return fail(1, "%v", err)
	}
	log.Info("stopped")
	return 0
}
