package kvgate

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strings"
)

// sseDone is the data of the event that ends an OpenAI-style stream.
const sseDone = "[DONE]"

// sseBOM is a byte order mark, which the SSE grammar allows once before the stream's first
// line; left on that line it would hide the first field's name.
const sseBOM = "\ufeff"

// maxSSELine bounds one line of a stream (a chunk of a few tokens is well under 1 KiB).
const maxSSELine = 4 << 20

// errLineTooLong reports a stream line above maxSSELine.
var errLineTooLong = errors.New("kvgate: stream line longer than 4 MiB")

// sseReader returns the data of each complete server-sent event (multi-line data joined with
// "\n"), reading only as much of the body as the next event needs: each event reaches the
// caller as soon as its blank line has arrived.
type sseReader struct {
	sc      *bufio.Scanner
	data    []string
	done    bool
	started bool
}

func newSSEReader(r io.Reader) *sseReader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxSSELine)
	sc.Split((&sseLines{}).split)
	return &sseReader{sc: sc}
}

// sseLines splits a body into lines as the SSE grammar does: a line ends at CR, LF or CRLF, as
// in the Python SDK (bufio.ScanLines knows LF only, so a stream framed by bare CRs would be read
// to its end as one line). A line ended by a CR is returned at once, since that CR may be the
// last byte before the server waits; an LF that then starts the next read is the rest of a
// CRLF, and skipped in the same call as the line after it is found: a call that skipped it
// alone would return no token, on which bufio.Scanner reads again before it looks at what it
// holds, and an event already received would wait for the server's next write.
type sseLines struct {
	skipLF bool
}

func (l *sseLines) split(data []byte, atEOF bool) (int, []byte, error) {
	skip := 0
	if l.skipLF && len(data) > 0 {
		l.skipLF = false
		if data[0] == '\n' {
			skip = 1
		}
	}
	rest := data[skip:]
	i := bytes.IndexAny(rest, "\r\n")
	switch {
	case i < 0 && atEOF && len(rest) > 0:
		return len(data), rest, nil
	case i < 0:
		return skip, nil, nil // no line end held: more must be read anyway
	case rest[i] == '\n':
		return skip + i + 1, rest[:i], nil
	case i+1 < len(rest) && rest[i+1] == '\n':
		return skip + i + 2, rest[:i], nil
	case i+1 == len(rest):
		l.skipLF = true
	}
	return skip + i + 1, rest[:i], nil
}

// next returns the next event's data; io.EOF after [DONE], ErrIncompleteStream at an end of
// the body that came before it: only [DONE] tells a whole answer from one cut short.
func (s *sseReader) next() (string, error) {
	if s.done {
		return "", io.EOF
	}
	for s.sc.Scan() {
		line := s.sc.Text()
		if !s.started {
			s.started = true
			line = strings.TrimPrefix(line, sseBOM)
		}
		if data, ok := s.feed(line); ok {
			return s.emit(data)
		}
	}
	if err := s.sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			err = errLineTooLong
		}
		return "", err
	}
	if len(s.data) > 0 {
		data := strings.Join(s.data, "\n")
		s.data = nil
		return s.emit(data)
	}
	return "", ErrIncompleteStream
}

func (s *sseReader) emit(data string) (string, error) {
	if data == sseDone {
		s.done = true
		return "", io.EOF
	}
	return data, nil
}

// feed takes one line; it returns an event's data when the line completes one.
func (s *sseReader) feed(line string) (string, bool) {
	if line == "" {
		if len(s.data) == 0 {
			return "", false
		}
		data := strings.Join(s.data, "\n")
		s.data = s.data[:0]
		return data, true
	}
	if strings.HasPrefix(line, ":") {
		return "", false // a comment or keep-alive
	}
	name, value := line, ""
	if i := strings.IndexByte(line, ':'); i >= 0 {
		name, value = line[:i], strings.TrimPrefix(line[i+1:], " ")
	}
	if name == "data" {
		s.data = append(s.data, value)
	}
	return "", false
}
