package admission

import (
	"context"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/internal/logging"
	"github.com/mgpu-dev/mgpu/kube/kubeclient"
)

const help = `mgpu-webhook is mgpu's mutating admission webhook for pods. It checks
the mgpu requests of a pod being created, and refuses one whose requests are
wrong with a message naming the field:

  ` + string(ResourceCore) + `    1 to 100 (a share of one GPU) or a multiple of 100 (whole GPUs)
  ` + string(ResourceMemory) + `  MiB, a whole number above 0; needed with a share
                                  of a GPU, and only with mgpu-core
  annotation ` + PolicyKey + `
      fixed-share (the default), guaranteed-burst-share or native-burst-share

A pod that asks for mgpu-core gets the annotation set to its policy and a
required node affinity to nodes labelled ` + PolicyKey + `=<policy>.
With the API server (--kubeconfig, $KUBECONFIG or in-cluster), a pending
pod whose policy no node runs gets a FailedScheduling event naming it, and
in namespaces labelled ` + TranslateLabel + `=true the requests (mgpu's, and
ACK's aliyun.com/gpu-core.percentage and aliyun.com/gpu-mem) become DRA
claims of per-namespace ResourceClaimTemplates of DeviceClass gpu.mgpu.io,
for nodes in mode dra.
It serves POST ` + MutatePath + ` (AdmissionReview admission.k8s.io/v1) and GET ` + HealthPath + `
over TLS, reading the certificate files again when they change. See
docs/kubernetes.md.

Usage:
  mgpu-webhook --tls-cert-file FILE --tls-key-file FILE [flags]  serve
  mgpu-webhook cert --out DIR [flags]   make a CA and a serving certificate
                                        (mgpu-webhook cert --help)

Flags:
`

const certHelp = `mgpu-webhook cert makes a CA and a serving certificate it signs (ECDSA
P-256), for <service>.<namespace>.svc and <service>.<namespace>.svc.cluster.local
and the names of --dns and --ip, and writes them into DIR as ` + CAFile + `,
` + CertFile + ` and ` + KeyFile + ` (the keys of a kubernetes.io/tls Secret). The CA's key is
not kept. It prints the CA certificate in base64 on stdout: the caBundle
of the MutatingWebhookConfiguration. See docs/kubernetes.md.

Usage: mgpu-webhook cert --out DIR [flags]

Flags:
`

// Command is mgpu-webhook: it parses args (without the program name) and
// either serves the webhook until SIGTERM or SIGINT or, with the
// subcommand cert, writes a certificate. It returns the exit status: 2
// for bad flags, 1 when it cannot run. --help goes to stdout, errors are
// one line on stderr, logs go to stderr.
func Command(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "cert" {
		return certCommand(args[1:], stdout, stderr)
	}
	fs := flag.NewFlagSet("mgpu-webhook", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are written below, in one line
	certFile := fs.String("tls-cert-file", "", "serving certificate `FILE` (PEM), with its CA chain; read again when it changes")
	keyFile := fs.String("tls-key-file", "", "serving key `FILE` (PEM)")
	listen := fs.String("listen", ":8443", "`ADDRESS` to serve HTTPS on")
	level := fs.String("log-level", "info", "`LEVEL`: debug, info, warn or error")
	format := fs.String("log-format", "text", "`FORMAT`: text or json")
	kubeconfig := fs.String("kubeconfig", "", "`FILE` of the API server, to explain pods no node's policy can take (default $KUBECONFIG, else in-cluster, else none)")
	explain := fs.Duration("explain-interval", DefaultExplainInterval, "how often to look for such pods (`DURATION`)")
	fail := failer("mgpu-webhook", stderr)
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
		return fail(2, "unknown command %q (see --help)", fs.Arg(0))
	}
	if *certFile == "" || *keyFile == "" {
		return fail(2, "--tls-cert-file and --tls-key-file are required (see --help)")
	}
	if *explain <= 0 {
		return fail(2, "--explain-interval %v: must be positive", *explain)
	}
	log, err := logging.New(stderr, *level, *format)
	if err != nil {
		return fail(2, "%v", err)
	}
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		return fail(1, "%v", err)
	}
	client, err := kubeclient.Client(*kubeconfig)
	switch {
	case errors.Is(err, kubeclient.ErrNone):
		log.Debug("no API server: pods that no node's compute policy can take get only the scheduler's message, and no namespace's pods are translated into DRA claims", "err", err)
		client = nil
	case err != nil:
		_ = l.Close()
		return fail(2, "%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	var tr *Translator
	if client != nil {
		wg.Go(func() { NewExplainer(client, log).Run(ctx, *explain) })
		tr = NewTranslator(client)
	}
	if err := Serve(ctx, l, *certFile, *keyFile, log, tr); err != nil {
		cancel()
		return fail(1, "%v", err)
	}
	log.Info("stopped")
	return 0
}

func certCommand(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("mgpu-webhook cert", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var o CertOptions
	fs.StringVar(&o.Service, "service", "mgpu-webhook", "`NAME` of the webhook's Service")
	fs.StringVar(&o.Namespace, "namespace", ExcludedNamespace, "`NAMESPACE` of the webhook's Service")
	out := fs.String("out", "", "`DIR` to write "+CAFile+", "+CertFile+" and "+KeyFile+" into (created)")
	var dns, ips list
	fs.Var(&dns, "dns", "a further DNS `NAME` of the certificate (repeatable)")
	fs.Var(&ips, "ip", "an IP `ADDRESS` of the certificate, e.g. 127.0.0.1 (repeatable)")
	fs.DurationVar(&o.Validity, "valid-for", DefaultValidity, "`DURATION` the certificates are valid, e.g. 8760h (a year)")
	force := fs.Bool("force", false, "replace the files in DIR (the caBundle changes)")
	fail := failer("mgpu-webhook cert", stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, certHelp)
			fs.SetOutput(stdout)
			fs.PrintDefaults()
			return 0
		}
		return fail(2, "%v (see --help)", err)
	}
	if fs.NArg() > 0 {
		return fail(2, "takes no arguments, got %q (see --help)", fs.Arg(0))
	}
	if *out == "" {
		return fail(2, "--out is required (see --help)")
	}
	if o.Validity <= 0 {
		return fail(2, "--valid-for %v is not a duration above 0", o.Validity)
	}
	o.DNSNames = dns
	for _, s := range ips {
		ip := net.ParseIP(s)
		if ip == nil {
			return fail(2, "--ip %q is not an IP address", s)
		}
		o.IPs = append(o.IPs, ip)
	}
	now := time.Now()
	o.Now = func() time.Time { return now }
	certs, err := GenerateCerts(o)
	if err != nil {
		return fail(2, "%v", err)
	}
	if err := certs.Write(*out, *force); err != nil {
		if errors.Is(err, os.ErrExist) {
			return fail(1, "%v (--force replaces the files, and the caBundle with them)", err)
		}
		return fail(1, "%v", err)
	}
	fmt.Fprintln(stdout, base64.StdEncoding.EncodeToString(certs.CA))
	fmt.Fprintf(stderr, "mgpu-webhook cert: wrote %s, %s and %s, valid until %s; the caBundle is on stdout\n",
		filepath.Join(*out, CAFile), CertFile, KeyFile, now.Add(o.Validity).UTC().Format(time.RFC3339))
	return 0
}

// failer returns a function that writes one line on stderr and returns
// status.
func failer(prog string, stderr io.Writer) func(status int, format string, a ...any) int {
	return func(status int, format string, a ...any) int {
		fmt.Fprintf(stderr, prog+": "+format+"\n", a...)
		return status
	}
}

// list is a repeatable string flag.
type list []string

func (l *list) String() string { return strings.Join(*l, ",") }

func (l *list) Set(s string) error {
	*l = append(*l, s)
	return nil
}
