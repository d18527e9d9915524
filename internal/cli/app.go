// Package cli implements mgpu-cli, the operator's command-line tool.
package cli

import (
	"errors"
	"fmt"
	"io"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/version"
)

// Exit statuses.
const (
	exitFailure = 1 // the command failed
	exitUsage   = 2 // bad input: flags, arguments or configuration
)

// usageError marks an error caused by the user's input (exit status 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

// commands lists mgpu-cli's commands; each file of this package adds its own.
var commands []*cli.Command

// App builds the mgpu-cli application.
func App(stdout, stderr io.Writer) *cli.App {
	return &cli.App{
		Name:  "mgpu-cli",
		Usage: "inspect and operate mgpu, GPU sharing for containers",
		Description: "mgpu shares each NVIDIA GPU of a node between containers, each with a memory\n" +
			"quota (MiB) and a compute quota (percent of GPU time). See docs/ for every\n" +
			"command, key and file.",
		Version:         version.String(),
		HideVersion:     true,
		Writer:          stdout,
		ErrWriter:       stderr,
		HideHelpCommand: true,
		Flags: []cli.Flag{
			&cli.StringFlag{
				Name:    "config",
				Usage:   "node configuration `FILE` (default " + config.DefaultPath + ")",
				EnvVars: []string{config.EnvPath},
			},
		},
		Commands:       commands,
		ExitErrHandler: func(*cli.Context, error) {},
	}
}

// Main runs mgpu-cli with args and returns the process exit status.
func Main(args []string, stdout, stderr io.Writer) int {
	return exitCode(App(stdout, stderr).Run(args), stderr)
}

// exitCode writes err, what an application's Run returned, to stderr and
// returns the process exit status.
func exitCode(err error, stderr io.Writer) int {
	if err == nil {
		return 0
	}
	var es exitStatus
	if errors.As(err, &es) && es.silent {
		return es.code
	}
	fmt.Fprintf(stderr, "mgpu: %v\n", err)
	var ue usageError
	var ce *config.Error
	if errors.As(err, &ue) || errors.As(err, &ce) {
		return exitUsage
	}
	var ee cli.ExitCoder
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return exitFailure
}

// loadConfig loads the configuration named by --config / MGPU_CONFIG.
func loadConfig(c *cli.Context) (*config.Config, error) {
	return config.Load(config.Resolve(c.String("config")))
}

func init() {
	commands = append(commands, &cli.Command{
		Name:  "version",
		Usage: "print mgpu's version",
		Action: func(c *cli.Context) error {
			_, err := fmt.Fprintf(c.App.Writer, "mgpu-cli %s\n", version.String())
			return err
		},
	})
}
