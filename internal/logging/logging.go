// Package logging builds the log/slog logger of mgpu's daemons from their
// --log-level and --log-format flags.
package logging

import (
	"fmt"
	"io"
	"log/slog"
)

// New returns a logger writing to w at level (debug, info, warn or error)
// in format (text or json). A bad value is an error naming its flag.
func New(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("bad --log-level %q (want debug, info, warn or error)", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("bad --log-format %q (want text or json)", format)
	}
}
