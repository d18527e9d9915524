package engine

import (
	"bytes"
	"fmt"
	"strconv"
)

// addImport adds path to the top-level `imports` array of the TOML document
// text, editing the text so that comments, formatting and every other
// setting stay as they are. Without an `imports` key it inserts one after
// the top-level `version` line (or before the first table). The caller
// checks that text is valid TOML and that path is not imported yet.
func addImport(text []byte, path string) ([]byte, error) {
	s := scanTop(text)
	if s.err != nil {
		return nil, s.err
	}
	quoted := strconv.Quote(path)
	var out bytes.Buffer
	switch {
	case s.importsOpen >= 0:
		// imports = [ ... ]: add the path as the last element.
		inner := text[s.importsOpen+1 : s.importsClose]
		multiline := bytes.ContainsRune(inner, '\n')
		switch {
		case s.lastValueEnd < 0: // empty array
			out.Write(text[:s.importsOpen+1])
			out.WriteString(quoted)
			out.Write(text[s.importsClose:])
		case !multiline:
			out.Write(text[:s.lastValueEnd])
			out.WriteString(", " + quoted)
			out.Write(text[s.lastValueEnd:])
		default:
			// One element per line: put the path on its own line before
			// the line of the closing bracket, after a comma.
			lineStart := bytes.LastIndexByte(text[:s.importsClose], '\n') + 1
			if len(bytes.TrimSpace(text[lineStart:s.importsClose])) > 0 {
				// "... "last"]": the bracket shares a line with a value.
				out.Write(text[:s.lastValueEnd])
				out.WriteString(",\n  " + quoted)
				out.Write(text[s.lastValueEnd:])
				break
			}
			out.Write(text[:s.lastValueEnd])
			if !s.trailingComma {
				out.WriteString(",")
			}
			out.Write(text[s.lastValueEnd:lineStart])
			out.WriteString("  " + quoted + ",\n")
			out.Write(text[lineStart:])
		}
	case s.versionEOL >= 0:
		out.Write(text[:s.versionEOL])
		out.WriteString("\nimports = [" + quoted + "]")
		out.Write(text[s.versionEOL:])
	default:
		out.Write(text[:s.firstTable])
		if s.firstTable > 0 && text[s.firstTable-1] != '\n' {
			out.WriteByte('\n') // a last line without a newline
		}
		out.WriteString("imports = [" + quoted + "]\n")
		out.Write(text[s.firstTable:])
	}
	return out.Bytes(), nil
}

// topScan is what scanTop finds in the top-level part of a TOML document.
type topScan struct {
	firstTable    int // offset of the first table header, or len(text)
	versionEOL    int // end of the top-level version line, or -1
	importsOpen   int // offset of imports' '[', or -1
	importsClose  int // offset of the matching ']'
	lastValueEnd  int // end of the last element of imports, or -1
	trailingComma bool
	err           error
}

// scanTop walks the top-level key/value lines of text, skipping strings and
// comments, up to the first table header.
func scanTop(text []byte) topScan {
	s := topScan{firstTable: len(text), versionEOL: -1, importsOpen: -1, lastValueEnd: -1}
	i := 0
	for i < len(text) {
		// At the start of a line (outside any value).
		for i < len(text) && (text[i] == ' ' || text[i] == '\t' || text[i] == '\r' || text[i] == '\n') {
			i++
		}
		if i >= len(text) {
			break
		}
		switch text[i] {
		case '#':
			i = skipComment(text, i)
			continue
		case '[':
			s.firstTable = i
			return s
		}
		keyStart := i
		for i < len(text) && text[i] != '=' && text[i] != '\n' {
			i++
		}
		if i >= len(text) || text[i] != '=' {
			s.err = fmt.Errorf("unexpected text at offset %d", keyStart)
			return s
		}
		key := string(bytes.TrimSpace(text[keyStart:i]))
		i++ // '='
		for i < len(text) && (text[i] == ' ' || text[i] == '\t') {
			i++
		}
		if key == "imports" && i < len(text) && text[i] == '[' {
			s.importsOpen = i
		}
		end, err := skipValue(text, i, func(depth int, valueEnd int, comma bool) {
			if key == "imports" && depth == 1 {
				if valueEnd >= 0 {
					s.lastValueEnd, s.trailingComma = valueEnd, false
				}
				if comma {
					s.trailingComma = true
				}
			}
		})
		if err != nil {
			s.err = err
			return s
		}
		if key == "imports" && s.importsOpen >= 0 && s.importsClose == 0 {
			s.importsClose = end - 1
		}
		i = end
		// The rest of the line: spaces and perhaps a comment.
		for i < len(text) && text[i] != '\n' {
			if text[i] == '#' {
				i = skipComment(text, i)
				break
			}
			i++
		}
		if key == "version" {
			s.versionEOL = i
		}
	}
	return s
}

func skipComment(text []byte, i int) int {
	for i < len(text) && text[i] != '\n' {
		i++
	}
	return i
}

// skipValue returns the offset just past the value starting at i. For
// arrays it reports, through elem, the end of each element (valueEnd) and
// each separating comma, with the array depth.
func skipValue(text []byte, i int, elem func(depth, valueEnd int, comma bool)) (int, error) {
	depth := 0
	for i < len(text) {
		c := text[i]
		switch {
		case c == '"' || c == '\'':
			end, err := skipString(text, i)
			if err != nil {
				return 0, err
			}
			i = end
			if depth == 0 {
				return i, nil
			}
			elem(depth, i, false)
			continue
		case c == '#' && depth > 0:
			i = skipComment(text, i)
			continue
		case c == '[' || c == '{':
			depth++
		case c == ']' || c == '}':
			depth--
			if depth == 0 {
				return i + 1, nil
			}
			elem(depth, i+1, false)
		case c == ',' && depth > 0:
			elem(depth, -1, true)
		case depth == 0 && (c == '\n' || c == '#'):
			return i, nil
		case depth > 0 && c != ' ' && c != '\t' && c != '\r' && c != '\n':
			// A bare value inside an array: number, boolean, date.
			j := i
			for j < len(text) && !bytes.ContainsRune([]byte(" \t\r\n,]}#"), rune(text[j])) {
				j++
			}
			elem(depth, j, false)
			i = j
			continue
		}
		i++
	}
	if depth > 0 {
		return 0, fmt.Errorf("unterminated array")
	}
	return i, nil
}

func skipString(text []byte, i int) (int, error) {
	q := text[i]
	if bytes.HasPrefix(text[i:], []byte{q, q, q}) {
		end := bytes.Index(text[i+3:], []byte{q, q, q})
		if end < 0 {
			return 0, fmt.Errorf("unterminated string")
		}
		j := i + 3 + end + 3
		for j < len(text) && text[j] == q { // """a"""" ends with extra quotes
			j++
		}
		return j, nil
	}
	for j := i + 1; j < len(text); j++ {
		switch text[j] {
		case '\\':
			if q == '"' {
				j++
			}
		case q:
			return j + 1, nil
		case '\n':
			return 0, fmt.Errorf("unterminated string")
		}
	}
	return 0, fmt.Errorf("unterminated string")
}
