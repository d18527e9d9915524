// Package fsutil holds file-system helpers shared by mgpu's commands.
package fsutil

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// WriteFileAtomic replaces path with data so that readers see the old or the
// new file, never a partial one: a temporary file in the same directory,
// mode, fsync, rename, fsync of the directory. The temporary name starts
// with "." and ends in neither .json nor .yaml nor .toml, so no directory
// scanner (a CDI cache, an engine's drop-in loader) picks it up. Errors name
// path, never the temporary file.
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, UnwrapPath(err))
	}
	tmp := f.Name()
	defer func() { _ = os.Remove(tmp) }() // fails harmlessly once renamed
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil {
		err = syncDir(dir)
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, UnwrapPath(err))
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir) //nolint:gosec // the directory of a file the caller writes
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
}

// UnwrapPath drops the path of a *PathError or *LinkError: callers name the
// file the operator knows, not a temporary one.
func UnwrapPath(err error) error {
	var pe *os.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		return pe.Err
	case errors.As(err, &le):
		return le.Err
	}
	return err
}
