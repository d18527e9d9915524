package hook

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/version"
)

// Exit statuses of mgpu-hook.
const (
	exitRefused = 1 // create: the container must not start
	exitUsage   = 2 // unknown command or flag
)

// grace is how long past its deadline (and rollback) a verb may run before
// Main gives up on it, whatever it is blocked in.
const grace = 500 * time.Millisecond

// App builds the mgpu-hook command line. Options are passed to New (tests).
func App(stdin io.Reader, stdout, stderr io.Writer, opts ...Option) *cli.App {
	flags := []cli.Flag{
		&cli.StringFlag{
			Name:    "config",
			Usage:   "node configuration `FILE` (default " + config.DefaultPath + ")",
			EnvVars: []string{config.EnvPath},
		},
		&cli.DurationFlag{
			Name:  "timeout",
			Usage: "give up after `DURATION` (the CDI spec gives the hook 10s; rollback adds up to " + RollbackTimeout.String() + ")",
			Value: DefaultTimeout,
		},
	}
	return &cli.App{
		Name:  "mgpu-hook",
		Usage: "OCI hook of mgpu: admit a container's GPU shares, release them",
		Description: "Runs from the hooks of the mgpu CDI spec, with the OCI state on stdin:\n" +
			"  createRuntime: mgpu-hook create   asks each requested device's enforcer for an instance\n" +
			"  poststop:      mgpu-hook destroy  releases the container's instances (never fails)\n" +
			"Requests: annotations vke.volcengine.com/mgpu-core, vke.volcengine.com/mgpu-memory,\n" +
			"vke.volcengine.com/mgpu-compute-policy, or env MGPU_CORE, MGPU_MEMORY, MGPU_COMPUTE_POLICY\n" +
			"(annotations win). A Kubernetes pod's container (CRI annotations) gets its quota from\n" +
			"the node agent on <run_dir>/kube-agent.sock instead. See docs/hook.md.",
		Version:         version.String(),
		HideVersion:     true,
		Reader:          stdin,
		Writer:          stdout,
		ErrWriter:       stderr,
		HideHelpCommand: true,
		Flags:           flags,
		Commands: []*cli.Command{
			{
				Name:         "create",
				Usage:        "createRuntime hook: admit the container on each of its mgpu devices",
				OnUsageError: onUsageError,
				Action: func(c *cli.Context) error {
					return bounded(c, "create", func(ctx context.Context) error {
						return runCreate(ctx, c, stderr, opts)
					})
				},
			},
			{
				Name:         "destroy",
				Usage:        "poststop hook: release the container's instances (idempotent, always exits 0)",
				OnUsageError: onUsageError,
				Action: func(c *cli.Context) error {
					err := bounded(c, "destroy", func(ctx context.Context) error {
						runDestroy(ctx, c, stderr, opts)
						return nil
					})
					if err != nil {
						fmt.Fprintf(stderr, "mgpu: destroy: %s\n", oneLine(err))
					}
					return nil
				},
			},
		},
		Action: func(c *cli.Context) error {
			if c.NArg() > 0 {
				return usageError{fmt.Errorf("unknown command %q (want create or destroy)", c.Args().First())}
			}
			_ = cli.ShowAppHelp(c)
			return usageError{errors.New("no command (want create or destroy)")}
		},
		OnUsageError:   onUsageError,
		ExitErrHandler: func(*cli.Context, error) {},
	}
}

// onUsageError reports a bad flag in one line, without the help text.
func onUsageError(_ *cli.Context, err error, _ bool) error { return usageError{err} }

// bounded runs fn with the --timeout deadline and returns its error, or
// gives up grace after the deadline and rollback, whatever fn is blocked in.
func bounded(c *cli.Context, verb string, fn func(ctx context.Context) error) error {
	timeout := c.Duration("timeout")
	if timeout <= 0 {
		return usageError{fmt.Errorf("--timeout must be positive, got %s", timeout)}
	}
	ctx, cancel := context.WithTimeout(c.Context, timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t := time.NewTimer(timeout + RollbackTimeout + grace)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return fmt.Errorf("%s gave up after %s (--timeout %s)", verb, timeout+RollbackTimeout+grace, timeout)
	}
}

func runCreate(ctx context.Context, c *cli.Context, _ io.Writer, opts []Option) error {
	st, err := readState(ctx, c.App.Reader)
	if err != nil {
		return err
	}
	cfg, err := config.Load(config.Resolve(c.String("config")))
	if err != nil {
		return err
	}
	_, err = New(cfg, append([]Option{WithLog(c.App.ErrWriter)}, opts...)...).Create(ctx, st)
	return err
}

func runDestroy(ctx context.Context, c *cli.Context, stderr io.Writer, opts []Option) {
	st, err := readState(ctx, c.App.Reader)
	if err != nil {
		fmt.Fprintf(stderr, "mgpu: destroy: %s\n", oneLine(err))
		return
	}
	cfg, err := config.Load(config.Resolve(c.String("config")))
	if err != nil {
		fmt.Fprintf(stderr, "mgpu: destroy %s: %s\n", st.ID, oneLine(err))
		return
	}
	_, errs := New(cfg, append([]Option{WithLog(stderr)}, opts...)...).Destroy(ctx, st)
	for _, e := range errs {
		fmt.Fprintf(stderr, "mgpu: destroy %s: %s\n", st.ID, oneLine(e))
	}
}

// readState parses the OCI state on r, giving up when ctx ends (a runtime
// that never closes stdin must not hang the hook).
func readState(ctx context.Context, r io.Reader) (*oci.State, error) {
	ch := make(chan struct {
		st  *oci.State
		err error
	}, 1)
	go func() {
		st, err := ParseState(r)
		ch <- struct {
			st  *oci.State
			err error
		}{st, err}
	}()
	select {
	case res := <-ch:
		return res.st, res.err
	case <-ctx.Done():
		return nil, fmt.Errorf("no OCI state on stdin within the timeout (%w)", ctx.Err())
	}
}

type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// Main runs mgpu-hook and returns its exit status. A failure is one line on
// stderr that starts with "mgpu: ".
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer, opts ...Option) int {
	err := App(stdin, stdout, stderr, opts...).Run(args)
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "mgpu: %s\n", oneLine(err))
	var ue usageError
	if errors.As(err, &ue) {
		return exitUsage
	}
	return exitRefused
}

// oneLine folds a multi-line error into one line.
func oneLine(err error) string {
	return strings.TrimSpace(strings.NewReplacer("\r\n", "; ", "\n", "; ", "\r", "; ").Replace(err.Error()))
}
